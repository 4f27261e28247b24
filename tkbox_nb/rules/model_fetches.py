"""What a model request asks the provider to fetch or run on its side, read from the request body, sans-IO.

A model request is signed, but the provider acts on parts of it past the egress door: a server-side web search or
web fetch tool goes wherever the model is told to (and the box writes the prompt), an MCP server or connector is a URL
the provider connects to, and an image, document or file given by URL is downloaded by the provider. Any of these lets
a box send data to a host of its choosing through the provider. So the door lists them (`fetches`), states them in
the call's signed facts, and `policy/models.decide` refuses them by default (`[models] server_tools = "refuse"`) or
decides each URL's host against `[egress]` (`"egress"`).

Read fail-closed: any tool object with a `type` that is not one the client runs itself (a function, a custom tool,
Anthropic's bash, text editor, computer and memory tools, OpenAI's computer use and local shell) is a server-side tool;
any string under a URL key (`url`, `image_url`, `file_url`, `server_url`, `document_url`) that is not a `data:` URL
is a remote URL, wherever in the body it is; Anthropic's `mcp_servers` and OpenAI chat's `web_search_options` are
named as such. Walked with a stack (no recursion) and cut at MAX_FETCHES, the cut itself stated.
"""

from __future__ import annotations

import re
from typing import Any

MAX_FETCHES = 32
URL_KEYS = ("url", "image_url", "file_url", "server_url", "document_url")
# tool types the client runs (the provider only asks for a call): OpenAI function/custom tools, computer use, local
# shell, apply_patch; Anthropic's client tools (no type, or "custom") and its versioned bash, text editor, computer
# and memory tools
CLIENT_TOOLS = re.compile(r"(function|custom|computer_use_preview|computer_use|local_shell|shell|apply_patch"
                          r"|(bash|text_editor|computer|memory)_[0-9a-z_]+)")
# server tools that reach no host the request chooses (OpenAI's file search, code interpreter and image generation,
# Anthropic's code execution run in the provider's sandbox without network): decided as tools, with no host
NO_NETWORK_TOOLS = re.compile(r"(file_search|code_interpreter|image_generation|code_execution_[0-9a-z_]+)")
# web tools may name the domains they are kept to (Anthropic `allowed_domains`; OpenAI `filters.allowed_domains`)
WEB_TOOLS = re.compile(r"(web_search|web_search_preview|web_search_preview_[0-9_]+|web_search_[0-9]+"
                       r"|web_fetch_[0-9]+)")


def _domains(tool: dict) -> list[str] | None:
    domains = tool.get("allowed_domains")
    filters = tool.get("filters")
    if domains is None and isinstance(filters, dict):
        domains = filters.get("allowed_domains")
    if isinstance(domains, list) and domains and all(isinstance(d, str) for d in domains):
        return [d[:253] for d in domains[:MAX_FETCHES]]
    return None


def _tool(tool: dict, where: str) -> dict | None:
    kind = tool.get("type")
    if not isinstance(kind, str) or CLIENT_TOOLS.fullmatch(kind):
        return None
    out: dict[str, Any] = {"kind": "tool", "tool": kind[:80], "where": where}
    if kind == "mcp":
        out["kind"] = "mcp"
        url = tool.get("server_url")
        if isinstance(url, str):
            out["url"] = url[:500]
        elif isinstance(tool.get("connector_id"), str):
            out["connector"] = tool["connector_id"][:120]
    elif WEB_TOOLS.fullmatch(kind):
        out["domains"] = _domains(tool)
    elif NO_NETWORK_TOOLS.fullmatch(kind):
        out["network"] = False
    return out


def provider_fetches(doc: dict) -> list[dict]:
    """The server-side tools, MCP servers and remote URLs a request body names, in the order found: each a dict with
    `kind` ("tool", "mcp" or "url") and `where` (its JSON path), and as they apply `tool`, `url`, `domains` (a web
    tool's allowed domains, None when it names none), `connector`, `network` (False for a tool that reaches no
    host). Past MAX_FETCHES one more entry of kind "cut" ends the list."""
    found: list[dict] = []
    servers = doc.get("mcp_servers")
    if servers is not None:
        for i, server in enumerate(servers if isinstance(servers, list) else [servers]):
            url = server.get("url") if isinstance(server, dict) else None
            found.append({"kind": "mcp", "where": f"mcp_servers[{i}]", **({"url": url[:500]} if isinstance(url, str)
                                                                           else {})})
    if "web_search_options" in doc:
        options = doc["web_search_options"]
        found.append({"kind": "tool", "tool": "web_search", "where": "web_search_options",
                      "domains": _domains(options) if isinstance(options, dict) else None})
    # each node with its place as a cell (parent cell, key): O(1) to make however deep, rendered only when named
    stack: list[tuple[Any, Any]] = [(doc, None)]
    while stack and len(found) <= MAX_FETCHES:
        node, cell = stack.pop()
        if isinstance(node, dict):
            entry = _tool(node, _where(cell)) if _is_tool(cell) else None
            if entry:
                found.append(entry)
            for k, v in reversed(list(node.items())):
                if cell is None and k in ("mcp_servers", "web_search_options"):
                    continue
                if isinstance(v, (dict, list)) or isinstance(v, str) and k in URL_KEYS:
                    stack.append((v, (cell, k)))
        elif isinstance(node, list):
            for i in range(len(node) - 1, -1, -1):
                if isinstance(node[i], (dict, list)):  # a string in a list sits under no URL key of its own
                    stack.append((node[i], (cell, i)))
        elif isinstance(node, str) and not node[:5].lower() == "data:":
            if not (cell[1] == "server_url" and _is_tool(cell[0])):  # stated with its tool
                found.append({"kind": "url", "where": _where(cell), "url": node[:500]})
    if len(found) > MAX_FETCHES:
        found = found[:MAX_FETCHES] + [{"kind": "cut", "where": f"more than {MAX_FETCHES}"}]
    return found


def _is_tool(cell: Any) -> bool:
    """Whether a place is an entry of the top-level `tools` list (where a tool object is)."""
    return cell is not None and isinstance(cell[1], int) and cell[0] is not None and cell[0] == (None, "tools")


def _where(cell: Any) -> str:
    """A place as a JSON path (`messages[0].content[2].source.url`), at most 200 characters."""
    keys = []
    while cell is not None:
        cell, key = cell
        keys.append(key)
    path = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in reversed(keys)).lstrip(".")
    return path[:200]
