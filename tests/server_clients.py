"""The `openai` clients the server tests talk through.

Why not a plain `openai.OpenAI(base_url=...)`: the server closes a keep-alive connection after 2 idle seconds
(`inference/entrypoints/openai/server.py`, so that a drain is not held open), and a test often spends about that
long on the offline engine between two requests. A client that reuses its pooled connection just as the server
closes it gets "Server disconnected without sending a response" (seen once in a full run, on a GET /models). A
real client retries that (the `openai` client's default `max_retries=2`); these clients must not retry, so that
every error a test sees is the server's. So each request asks for its own connection (`Connection: close`).
"""

from __future__ import annotations

import openai

_ONE_CONNECTION_A_REQUEST = {"Connection": "close"}


def openai_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    """A synchronous client of the server at `url` (its root, as `ServerThread` gives it): no retries, no reused
    connection."""
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0,
                         default_headers=_ONE_CONNECTION_A_REQUEST)


def async_openai_client(url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    """`openai_client`'s asynchronous twin."""
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0,
                              default_headers=_ONE_CONNECTION_A_REQUEST)
