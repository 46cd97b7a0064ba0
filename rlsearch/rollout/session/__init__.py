"""User agents as plain Python: a per-trajectory OpenAI-compatible endpoint on each rollout worker that records
every call token-exactly, and the runner that drives ``rollout.agent`` through it.

Public face: `AgentSession` and `AgentExample` (what an agent gets), `SessionEndpoint` (the endpoint),
`AgentRunner` and `load_agent` (the driver), `SessionTokens` (the token accounting, usable on its own).
"""

from .runner import AgentRunner, load_agent
from .server import SessionEndpoint
from .session import AgentExample, AgentSession, SessionTools
from .tokens import SessionTokens

__all__ = ["AgentExample", "AgentRunner", "AgentSession", "SessionEndpoint", "SessionTokens", "SessionTools",
           "load_agent"]
