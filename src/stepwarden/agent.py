"""The one import path for agents, ``stepwarden.agent``, that the package, the worker and tests use.

The code lives in modules split by role: ``agent_definition.py`` (what an application writes:
``Agent``, its operations, ``Request``, ``default_classify``), ``agent_role.py`` (the agent role a
worker runs) and ``agent_settings.py`` (how that role is tuned). This module re-exports the names
others import, so that the split broke no import. Patch a value the role reads where the role reads
it, in ``stepwarden.agent_role``.
"""

from .agent_definition import Agent, Handler, Request, default_classify
from .agent_role import AgentRole
from .agent_settings import STOP_WRITE_WAIT, AgentSettings

__all__ = [
    "STOP_WRITE_WAIT",
    "Agent",
    "AgentRole",
    "AgentSettings",
    "Handler",
    "Request",
    "default_classify",
]
