"""A stand-in sglang-diffusion worker on uvicorn and starlette, the server
and the router of the FastAPI app sglang-diffusion runs, for the router's
path tests. uvicorn unescapes the request path before the app routes it
(scope["path"]), so /v1%2Fset_lora reaches /v1/set_lora here as it would on
a real worker; starlette's router redirects a path it has no route for to
its twin with or without a trailing slash (307, to an absolute URL on the
Host it was sent), as FastAPI's does. GET /routed lists every path the app
was asked for, in order."""

import json

from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

routed = []

MODELS = {"object": "list", "data": [{"id": "stand-in", "object": "model", "task_type": "T2I"}]}


async def health(request):
    return JSONResponse({"status": "ok"})


async def models(request):
    return JSONResponse(MODELS)


async def lora(request):
    await request.body()
    return JSONResponse({"status": "ok", "message": "switched by " + request.scope["raw_path"].decode()})


routes = Starlette(routes=[
    Route("/health", health),
    Route("/health_generate", health),
    Route("/v1/models", models),
    Route("/v1/set_lora", lora, methods=["POST"]),
    Route("/v1/unmerge_lora_weights", lora, methods=["POST"]),
    Route("/v1/merge_lora_weights", lora, methods=["POST"]),
])


async def app(scope, receive, send):
    if scope["type"] == "http" and scope["path"] == "/routed":
        return await Response(json.dumps(routed), media_type="application/json")(scope, receive, send)
    if scope["type"] == "http":
        routed.append(scope["path"])
    await routes(scope, receive, send)
