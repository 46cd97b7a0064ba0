"""The tool servers, each run as its own process: retrieval (``python -m rlsearch.tools.servers.retrieval``) and
MCP (``python -m rlsearch.tools.servers.mcp``). Imported by module; this package re-exports nothing, so that the
rollout side never loads bm25s, fastapi or the MCP server."""
