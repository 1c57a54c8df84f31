"""A stand-in sglang-diffusion worker on uvicorn, the server sglang-diffusion
runs on, for the router's path tests. uvicorn unescapes the request path
before the app routes it (scope["path"]), so /v1%2Fset_lora reaches
/v1/set_lora here as it would on a real worker. GET /routed lists every
path the app routed, in order."""

import json

routed = []

MODELS = {"object": "list", "data": [{"id": "stand-in", "object": "model", "task_type": "T2I"}]}


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    path = scope["path"]
    while (await receive()).get("more_body"):
        pass
    if path == "/routed":
        return await answer(send, 200, routed)
    routed.append(path)
    if path in ("/health", "/health_generate"):
        return await answer(send, 200, {"status": "ok"})
    if path == "/v1/models":
        return await answer(send, 200, MODELS)
    if path in ("/v1/set_lora", "/v1/unmerge_lora_weights", "/v1/merge_lora_weights"):
        return await answer(send, 200, {"status": "ok", "message": "switched by " + scope["raw_path"].decode()})
    return await answer(send, 404, {"detail": "Not Found"})


async def answer(send, status, body):
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})
