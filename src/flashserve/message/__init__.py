"""What crosses between processes: the messages of the front ends and the engine core, their codec,
the error shapes and the types they carry (`SamplingParams`, `RequestOutput`, `GrammarSpec`).

The bottom package: it imports nothing else of flashserve, so the engine, its clients and the API
all import it and never each other for these."""
