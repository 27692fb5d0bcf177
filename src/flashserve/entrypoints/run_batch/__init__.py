"""`flashserve run-batch`: the engine's process (`main.py`), the app's process (`app.py`), batch lines and resuming."""
