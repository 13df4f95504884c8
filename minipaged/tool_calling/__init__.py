"""Tool calling: tool definitions and ``tool_choice`` (``tools``), reading calls
out of a completion, streamed or whole (``parsers``), and the templates that
show tools to a model (``templates``). The server's chat route and
``LLM.chat(tools=...)`` use them; ``docs/serving.md`` says how to turn it on."""

from .parsers import (
    TOOL_PARSERS,
    Delta,
    ForcedCallsParser,
    HermesToolParser,
    NamedCallParser,
    ParsedOutput,
    StreamParser,
    ToolCall,
    ToolCallDelta,
    openai_pieces,
)
from .templates import chatml_tools_template, load_chat_template, reads_tools, template_for_tools
from .tools import ToolPlan, plan_tools, validate_tool_choice, validate_tools

__all__ = ["TOOL_PARSERS", "Delta", "ForcedCallsParser", "HermesToolParser", "NamedCallParser",
           "ParsedOutput", "StreamParser", "ToolCall", "ToolCallDelta", "ToolPlan",
           "chatml_tools_template", "load_chat_template", "openai_pieces", "plan_tools",
           "reads_tools",
           "template_for_tools", "validate_tool_choice", "validate_tools"]
