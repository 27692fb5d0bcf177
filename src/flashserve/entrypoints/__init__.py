"""What starts flashserve: `serve` (process supervision, uvicorn), the engine core process, front-end processes."""
