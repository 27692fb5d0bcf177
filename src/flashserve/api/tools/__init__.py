"""Tool calls: the models' formats parsed whole and streamed (parsers, streaming), and tools shown
as text to a model whose chat template cannot show them (render)."""
