"""Environments for multi-turn rollouts (docs/agents.md): the protocol, tool calls, the
environments that ship, and a gymnasium-style adapter.

May import: types, rewards.
"""

from rollwise.envs.base import Env, StepResult
from rollwise.envs.calc import CalcEnv, CalcError, LookupEnv, ToolEnv, safe_eval
from rollwise.envs.guess import GuessEnv
from rollwise.envs.gym import GymTextEnv
from rollwise.envs.tools import ToolCall, describe_tools, parse_tool_calls, tool_schema

__all__ = ["CalcEnv", "CalcError", "Env", "GuessEnv", "GymTextEnv", "LookupEnv",
           "StepResult", "ToolCall", "ToolEnv", "describe_tools", "parse_tool_calls",
           "safe_eval", "tool_schema"]
