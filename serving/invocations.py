"""POST /invocations: SageMaker's inference route, as vLLM serves it: one URL for every task, the body's shape
picking the route that answers it (`messages`: chat, `prompt`: completions, `input`: embeddings, `query` with
`documents`: rerank, `text_1`: score). The answer, and any error, is that route's."""
from __future__ import annotations

from starlette.requests import Request
from starlette.routing import Route

from serving import embeddings_routes, openai_routes
from serving.errors import invalid
from serving.state import read_json

# (body key, the route's handler, its path), tried in order
TASKS = (("messages", openai_routes.chat_completions, "/v1/chat/completions"),
         ("prompt", openai_routes.completions, "/v1/completions"),
         ("input", embeddings_routes.embeddings, "/v1/embeddings"),
         ("documents", embeddings_routes.rerank, "/rerank"),
         ("text_1", embeddings_routes.score, "/score"))


async def invocations(request: Request):
    body = await read_json(request)      # (kept by the request: the handler reads it again)
    for key, handler, _ in TASKS:
        if key in body:
            return await handler(request)
    raise invalid("/invocations takes a chat (`messages`), completion (`prompt`), embedding (`input`), rerank "
                  "(`query` and `documents`) or score (`text_1`, `text_2`) request")


ROUTES = [Route("/invocations", invocations, methods=["POST"])]
