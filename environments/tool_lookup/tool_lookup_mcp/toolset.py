"""The `lookup` tool as an MCP server (verifiers v1 `Toolset`): verifiers starts it once per run as
`python -m tool_lookup_mcp.toolset` and the harness reaches it over streamable HTTP on 127.0.0.1."""

from __future__ import annotations

import verifiers.v1 as vf
from tool_lookup import corpus


class LookupToolsetConfig(vf.SharedToolsetConfig):
    pass


class LookupToolset(vf.Toolset[LookupToolsetConfig]):
    TOOL_PREFIX = None  # advertised as plain `lookup`, as the classic env's tool

    @vf.tool
    async def lookup(self, name: str) -> str:
        """Looks a name up in the corpus and returns its three-digit code."""
        return corpus.lookup(name)


if __name__ == "__main__":
    LookupToolset.run()
