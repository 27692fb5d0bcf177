"""The front end's side of the engine core: its client, the codec of the messages between them, routing over
data-parallel engines, and output processing (detokenizing, stop strings)."""
