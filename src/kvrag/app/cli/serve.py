"""`kvrag serve` (the OpenAI-compatible API) and `kvrag export` (the weights it answers with, for another server)."""

import sys
import threading
import time
from pathlib import Path

from kvrag.errors import KVRagError

from . import common

LEARN_PROMPTS = 4096  # kvrag.engine.LEARN_PROMPTS


def cmd_serve(args):
    import uvicorn

    from kvrag.retrieval import PassageIndex

    from .. import client
    from ..server import create_app

    if not 0 <= args.shadow <= 1:
        raise KVRagError(f"--shadow is a share of requests between 0 and 1, got {args.shadow}")
    chroma = common.chroma(args)  # replicas given the same Chroma server share one passage index
    index = PassageIndex(chroma)
    options = {"max_request_bytes": args.max_request_bytes, "max_passages": args.max_passages,
               "passage_index": index, "embedder": index.embedder}
    engine = common.engine(args, max_batch=args.max_batch, max_queue=args.max_queue, learn_prompts=args.learn_prompts,
                           default_mode=args.mode or "calibrated", shadow=args.shadow)
    api_key = common.api_key(args)
    app = create_app(engine, api_key=api_key, model_name=args.served_model_name, **options)
    record = engine.calibration
    why = "--mode" if args.mode else "no calibration record: see `kvrag calibrate`" if record is None else \
        "calibrated" if record["chosen"] else "calibrated: no reusing setting kept full's answers"
    print(f"kvrag: requests that name no mode get {engine.default_mode} ({why})"
          f"{f'; {100 * args.shadow:g}% of the rest shadow-checked against full' if args.shadow else ''}", file=sys.stderr)
    print(f"kvrag: OpenAI-compatible API on http://{args.host}:{args.port}/v1"
          f"{' (API key required)' if api_key else ''}"
          f"{f'; passages in Chroma at {chroma}' if isinstance(chroma, str) else ''}", file=sys.stderr)
    local = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    advertised = client.advertise(common.home(args), f"http://{local}:{args.port}", common.answering_options(args),
                                  api_key if args.advertise_key else None, args.idle_exit or None)
    # on shutdown: uvicorn ends a SIGTERM by raising it again, which no `finally` here would outlive
    app.router.on_shutdown.append(lambda: client.withdraw(advertised))
    activity = Activity(app)
    server = uvicorn.Server(uvicorn.Config(activity, host=args.host, port=args.port, log_level=args.log_level))
    if args.idle_exit:
        threading.Thread(target=_exit_when_idle, args=(server, activity, args.idle_exit, advertised),
                         daemon=True).start()
    try:
        server.run()
    finally:
        client.withdraw(advertised)


class Activity:
    """ASGI wrapper counting the requests in flight and when the last one ended, for `--idle-exit`."""

    def __init__(self, app):
        self.app, self.active, self.last = app, 0, time.monotonic()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
            self.last = time.monotonic()


def _exit_when_idle(server, activity: Activity, seconds: float, advertised: Path) -> None:
    """Stop `server` once no request came for `seconds`, or once its home names another server (or none: the
    home was removed), whichever comes first, never in the middle of a request."""
    from .. import client

    while True:
        time.sleep(min(1.0, seconds / 4))
        idle = time.monotonic() - activity.last
        if not activity.active and (idle >= seconds or not client.advertised(advertised)):
            server.should_exit = True
            return


def cmd_export(args):
    """The weights this engine answers with, as a model directory another server loads (vLLM: docs/vllm.md)."""
    from kvrag import loading

    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KVRagError(f"{out} exists: export writes a new model directory")
    engine = common.engine(args, warm_up=False)
    loading.export(engine.model, engine.tokenizer, out)
    print(f"kvrag: wrote {out} ({str(engine.model.dtype).removeprefix('torch.')}, weights "
          f"{loading.weights_digest(engine.model)[:12]})", file=sys.stderr)


def register(sub) -> None:
    p = common.command(sub, "serve", "an OpenAI-compatible HTTP API: chat completions reusing passages' KV, embeddings")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 opens it to the network")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", help="key every /v1 request must send as 'Authorization: Bearer KEY' "
                                     "(default: $KVRAG_API_KEY, else none: open to whoever reaches the port)")
    p.add_argument("--mode", choices=common.MODES, help="mode of requests that name none, a request's kvrag.mode "
                                                        "choosing its own (default: what `kvrag calibrate` chose for "
                                                        "this model and home, else full)")
    p.add_argument("--shadow", type=float, default=0.0, metavar="SHARE",
                   help="share of greedy requests answered in a reusing mode that are answered again in full mode in "
                        "the background and compared (/metrics: kvrag_shadow_*); when the default mode's agreement "
                        "falls under the calibrated target, requests that name no mode step to a safer mode; 0: none")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model id /v1/models lists and requests send; more names are answered to as well "
                        "(default: the model directory's name, for the default model SmolLM2-135M-Instruct.Q4_1)")
    p.add_argument("--max-batch", type=int, default=16, help="requests whose decode steps run together")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait; more are refused with 429")
    p.add_argument("--max-request-bytes", type=int, help="largest request body taken, 400 beyond, checked as it "
                                                         "arrives (default: 64 bytes a token of the model's context "
                                                         "window, at least 1 MiB)")
    p.add_argument("--max-passages", type=int, default=256, help="most passages one POST /v1/passages may carry")
    p.add_argument("--learn-prompts", type=int, default=LEARN_PROMPTS, metavar="N",
                   help="most passages learned from the messages themselves (text between blank lines), reused by "
                        "later requests in the reusing modes; 0: none (default: %(default)s)")
    p.add_argument("--idle-exit", type=float, default=0, metavar="SECONDS",
                   help="stop after this many seconds without a request, or once another server is started for this "
                        "home (`kvrag ask` starts one so to keep the model warm); 0: never")
    p.add_argument("--advertise-key", action="store_true",
                   help="write the API key into the home's serve.json (readable by this user only), so that `kvrag "
                        "ask` and `kvrag index` in this home use this server without being given the key")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")
    p.set_defaults(func=cmd_serve)

    p = common.command(sub, "export", "write the weights kvrag answers with (adapter merged) as a model directory")
    p.add_argument("out", help="new directory for config, safetensors and tokenizer, e.g. for `vllm serve`")
    p.set_defaults(func=cmd_export)
