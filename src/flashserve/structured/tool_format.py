"""The tags of the generic tool-call format (the Hermes format, which many models were trained on).

A call is written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, a tool's result
`<tool_response>...</tool_response>`. `api/tools/render.py` writes them into prompts whose chat
template cannot show tools, `api/tools/parsers.py` reads calls back, and the grammar of
`tool_choice: "auto"` (`compiler.generic_tool_spec`) lets the model write calls and never a result.
"""

from __future__ import annotations

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
