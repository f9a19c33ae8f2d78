"""``llmesh``: run and inspect a mesh.

    llmesh up       start all five services on this machine (--secure: mTLS and API keys, as in production)
    llmesh status   services, endpoints and models of a running mesh
    llmesh chat     stream a chat answer through the gateway's gRPC API
    llmesh config   read, check and change the live config
    llmesh keys     create, list, rotate and revoke API keys
    llmesh usage    tokens and cost per tenant, model and day
    llmesh audit    check the audit log's hash chain
    llmesh models   model registry: import, deploy, promote, rollback, history, eval
    llmesh cache    response cache: stats, invalidate
    llmesh shadow   shadow traffic: report how a shadow version compared
    llmesh batches  the Batch API's batches: list, show
    llmesh certs    make the mesh's CA and service certificates (for compose's init service)
    llmesh bench    run a benchmark of a checkout's bench/ (python -m bench lists them)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from llmesh.cli.layout import Layout

if TYPE_CHECKING:
    from llmesh.cli.up import MeshSpec
    from llmesh.restarts import RestartPolicy


def _layout(args: argparse.Namespace) -> Layout:
    return Layout(base_port=args.base_port, http_port=args.http_port)


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-port", type=int, default=Layout.base_port,
                   help="gateway gRPC port; scheduler, modelmgr and cache take the next three, engines base+100…")
    p.add_argument("--http-port", type=int, default=Layout.http_port, help="gateway HTTP port")


def parse_engines(text: str) -> list[str]:
    """'llamacpp,sim:16' -> one llamacpp engine and sixteen sim engines (vllm: --vllm-model's)."""
    engines: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        backend, _, count = item.partition(":")
        if backend not in ("llamacpp", "sim", "vllm", "minilm"):
            raise ValueError(f"unknown engine backend {backend!r} (llamacpp, sim, vllm, minilm)")
        if count and not (count.isdigit() and int(count) >= 1):
            raise ValueError(f"bad engine count in {item!r}; write backend:N, N >= 1")
        engines += [backend] * int(count or 1)
    return engines


def parse_autoscale(items: list[str]) -> dict[str, str]:
    """['sim-small=sim'] -> {'sim-small': 'sim'}: models whose engines the autoscaler starts and stops."""
    scaled: dict[str, str] = {}
    for item in items:
        model, _, backend = item.partition("=")
        if not model or backend not in ("llamacpp", "sim"):
            raise ValueError(f"bad --autoscale {item!r}; write MODEL=BACKEND, BACKEND llamacpp or sim")
        if backend == "sim" and not model.startswith("sim"):
            raise ValueError(f"a sim engine's model name starts with 'sim', not {model!r}")
        scaled[model] = backend
    return scaled


def _up_options(args: argparse.Namespace) -> tuple[MeshSpec, dict[str, str], RestartPolicy]:
    """``llmesh up``'s arguments as (MeshSpec, autoscaled models, RestartPolicy); a ValueError
    says what is wrong with them."""
    from llmesh.cli.up import EMBED_MODEL, MeshSpec
    from llmesh.restarts import RestartPolicy

    engines = parse_engines(args.engines)
    if args.trust and not args.secure:
        raise ValueError("--trust goes with --secure")
    spec = MeshSpec(layout=_layout(args), engines=engines, model_dir=args.model_dir.resolve(),
                    log_dir=args.log_dir.resolve(), grace_s=args.grace, cache=not args.no_cache,
                    vllm_model=args.vllm_model, embeddings=not args.no_embeddings and "minilm" not in engines,
                    gateway_workers=args.gateway_workers, trust=(args.trust or "tls") if args.secure else "local")
    if args.secure:
        from llmesh.cli.secure import pki_dir, state_dir
        spec.pki_dir = pki_dir(state_dir().resolve())
    if args.gateway_workers < 1:
        raise ValueError("--gateway-workers must be >= 1")
    if "llamacpp" in engines and not (spec.model_dir / spec.model).is_dir():
        raise ValueError(f"no model '{spec.model}' in {spec.model_dir}; run 'make model' first")
    if "vllm" in engines and not (spec.model_dir / spec.vllm_model / "config.json").is_file():
        raise ValueError(f"no Hugging Face model directory '{spec.vllm_model}' in {spec.model_dir} for the vllm "
                         f"engines (--vllm-model; `make vllm-model` builds SmolLM2's)")
    # the embedder is served where `make model` put it (without it: no /v1/embeddings, as the banner says)
    spec.embeddings = spec.embeddings and (spec.model_dir / EMBED_MODEL / "model.safetensors").is_file()
    scaled = parse_autoscale(args.autoscale)
    if args.max_restarts < 0 or args.restart_window <= 0:
        raise ValueError("--max-restarts must be >= 0 and --restart-window > 0")
    return spec, scaled, RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window)


def cmd_up(args: argparse.Namespace) -> int:
    from llmesh.cli import secure
    from llmesh.cli.launcher import EngineLauncher, follow
    from llmesh.cli.up import StartFailed, plan, port_hint, start_all, stop_all, supervise, write_state

    try:
        spec, scaled, policy = _up_options(args)
    except ValueError as exc:
        print(f"llmesh: {exc}", file=sys.stderr)
        return 2
    layout = spec.layout
    state = secure.state_dir().resolve()
    try:
        identity = secure.prepare(spec, state)
    except (OSError, ValueError) as exc:
        secure.clear_marker(state)
        print(f"llmesh: cannot make the mesh's certificates under {spec.pki_dir}: {exc}", file=sys.stderr)
        return 2
    children = plan(spec)
    state_path = spec.log_dir / "supervisor.json"

    async def main() -> int:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"llmesh: starting {len(children)} services (logs in {spec.log_dir})", flush=True)
        try:
            await start_all(children, identity=identity)
        except StartFailed as exc:
            print(f"llmesh: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            hint = port_hint(children, layout)
            if hint:
                print(hint, file=sys.stderr, flush=True)
        write_state(children, state_path)  # before the banner: whoever waits for it may read the state at once
        print(_banner(layout, spec), flush=True)
        say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
        launcher = EngineLauncher(spec, children, scaled, say=say) if scaled else None
        following = (asyncio.create_task(follow(launcher, layout.address("scheduler"), stop,
                                                on_change=lambda: write_state(children, state_path),
                                                identity=identity))
                     if launcher else None)
        try:
            gave_up = await supervise(children, stop, policy, state_path, say=say)
        finally:
            if following is not None:
                following.cancel()
                await asyncio.gather(following, return_exceptions=True)
            if launcher is not None:
                await launcher.close()
        if gave_up:
            print(f"llmesh: {gave_up.name} exited {gave_up.exits} times within {gave_up.window_s:.0f}s "
                  f"(last exit code {gave_up.last_exit_code}), past its restart budget; stopping the mesh "
                  f"(see {spec.log_dir / gave_up.name}.log)", file=sys.stderr, flush=True)
        return 1 if gave_up else 0

    try:
        code = asyncio.run(main())
    finally:
        print("llmesh: stopping…", flush=True)
        results = stop_all(children, spec.grace_s)
        state_path.unlink(missing_ok=True)
        secure.clear_marker(state)
        print("llmesh: stopped " + ", ".join(f"{n} ({rc})" for n, rc in results), flush=True)
    return code


def _banner(layout: Layout, spec: MeshSpec) -> str:
    model = spec.engine_model(next((b for b in ("llamacpp", "vllm") if b in spec.engines), "sim"))
    url = layout.http_url
    if spec.trust != "local":
        return _secure_banner(layout, spec, model)
    return f"""llmesh is up: OpenAI-compatible API at {url}/v1, gRPC at {layout.address('gateway')}

  curl {url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Name three planets."}}]}}'

  python -c 'from openai import OpenAI
  c = OpenAI(base_url="{url}/v1", api_key="none")
  for ch in c.chat.completions.create(model="{model}", stream=True,
          messages=[{{"role": "user", "content": "Name three planets."}}]):
      print(ch.choices[0].delta.content or "", end="", flush=True)'
{_embeddings_line(spec, url)}
Ctrl-C stops every service."""


def _embeddings_line(spec: MeshSpec, url: str) -> str:
    from llmesh.cli.up import EMBED_MODEL
    if spec.embeddings or "minilm" in spec.engines:
        return f"""
  curl {url}/v1/embeddings -H 'content-type: application/json' \\
    -d '{{"model": "{EMBED_MODEL}", "input": ["Name three planets."]}}'
"""
    return ""


def _secure_banner(layout: Layout, spec: MeshSpec, model: str) -> str:
    url = layout.http_url
    return f"""llmesh is up (secure: trust {spec.trust}, certificates in {spec.pki_dir}): OpenAI-compatible API at \
{url}/v1, gRPC at {layout.address('gateway')}

Every request needs an API key (the tenant needs the model in the live config's tenants):

  llmesh keys create --tenant acme
  curl {url}/v1/chat/completions -H "authorization: Bearer $KEY" -H 'content-type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Name three planets."}}]}}'

Ctrl-C stops every service."""


def cmd_status(args: argparse.Namespace) -> int:
    from llmesh.cli.secure import cli_identity
    from llmesh.cli.status import collect, render

    try:
        identity = cli_identity()
    except ValueError as exc:  # IdentityError, or trust settings that do not validate
        print(f"llmesh status: no usable mesh identity (LLMESH_TRUST, LLMESH_TLS_*): {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(collect(_layout(args), args.log_dir / "supervisor.json", identity))
    print(render(report, as_json=args.json))
    return 0 if all(s["health"] == "SERVING" for s in report["services"]) else 1


def cmd_chat(args: argparse.Namespace) -> int:
    from llmesh.cli.chat import chat

    return asyncio.run(chat(_layout(args).address("gateway"), args.model, args.prompt,
                            args.max_tokens, args.temperature, os.environ.get("LLMESH_API_KEY")))


def cmd_config(args: argparse.Namespace) -> int:
    from llmesh.cli.config import run

    return asyncio.run(run(args))


def cmd_models(args: argparse.Namespace) -> int:
    from llmesh.cli.models import run

    return asyncio.run(run(args, args.address or _layout(args).address("modelmgr")))


def cmd_cache(args: argparse.Namespace) -> int:
    from llmesh.cli.cache import run

    return asyncio.run(run(args, _layout(args).address("cache")))


def cmd_batches(args: argparse.Namespace) -> int:
    from llmesh.cli.batches import run

    return asyncio.run(run(args, args.address or _layout(args).address("gateway"), os.environ.get("LLMESH_API_KEY")))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmesh", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the mesh on this machine")
    _add_layout_args(up)
    up.add_argument("--engines", default="llamacpp",
                    help="comma-separated backends, one engine each, backend:N for N of them: llamacpp, sim, "
                         "vllm (default: llamacpp; e.g. llamacpp,sim:16; \"\" for none, with --autoscale)")
    up.add_argument("--vllm-model", default="smollm2-135m-instruct-hf-fp32", metavar="NAME",
                    help="the vllm engines' model: a Hugging Face directory in --model-dir, served under its name "
                         "(vLLM's settings: LLMESH_ENGINE_VLLM_*)")
    up.add_argument("--autoscale", action="append", default=[], metavar="MODEL=BACKEND",
                    help="start and stop engines of MODEL on this machine as the scheduler's autoscaler wants "
                         "(the live config's autoscaling.models names its policy); repeatable")
    up.add_argument("--model-dir", type=Path, default=Path("var/models"))
    up.add_argument("--log-dir", type=Path, default=Path("var/log"))
    up.add_argument("--no-cache", action="store_true", help="the gateway skips the response cache")
    up.add_argument("--no-embeddings", action="store_true",
                    help="start no engine for all-minilm-l6-v2 (by default one serves /v1/embeddings)")
    up.add_argument("--grace", type=float, default=10.0, help="seconds in-flight work gets on stop")
    up.add_argument("--gateway-workers", type=int, default=1, metavar="N",
                    help="gateway worker processes sharing its ports (more than 1 needs LLMESH_REDIS_URL)")
    up.add_argument("--max-restarts", type=int, default=5,
                    help="a service that dies is restarted (backoff 0.5 s doubling to 10 s, jittered); more exits than "
                         "this within --restart-window stops the mesh")
    up.add_argument("--restart-window", type=float, default=60.0, help="seconds (see --max-restarts)")
    up.add_argument("--secure", action="store_true",
                    help="production trust on this machine: a CA and a certificate per service under "
                         "<state_dir>/pki (made on first start), identities checked on every internal call, "
                         "gateway API keys required (llmesh keys create)")
    up.add_argument("--trust", choices=("tls", "token"), default=None,
                    help="with --secure: mutual TLS (default) or plaintext gRPC with signed per-call tokens")
    up.set_defaults(func=cmd_up)

    status = sub.add_parser("status", help="show services, endpoints and models")
    _add_layout_args(status)
    status.add_argument("--json", action="store_true")
    status.add_argument("--log-dir", type=Path, default=Path("var/log"),
                        help="where `llmesh up` keeps its logs and supervisor.json (restart counts)")
    status.set_defaults(func=cmd_status)

    chat = sub.add_parser("chat", help="stream a chat answer (API key from LLMESH_API_KEY, if set)")
    _add_layout_args(chat)
    chat.add_argument("-m", "--model", required=True)
    chat.add_argument("prompt")
    chat.add_argument("--max-tokens", type=int, default=None)
    chat.add_argument("--temperature", type=float, default=None)
    chat.set_defaults(func=cmd_chat)

    from llmesh.cli.config import add_parser
    add_parser(sub)
    sub.choices["config"].set_defaults(func=cmd_config)

    from llmesh.cli.governance import add_parsers
    add_parsers(sub)
    from llmesh.cli.audit import add_parser as add_audit
    add_audit(sub)
    from llmesh.cli.models import add_parser as add_models
    models = add_models(sub)
    _add_layout_args(models)
    models.set_defaults(func=cmd_models)
    from llmesh.cli.shadow import add_parser as add_shadow
    add_shadow(sub)
    from llmesh.cli import cache
    cache.add_parser(sub, _add_layout_args)
    sub.choices["cache"].set_defaults(func=cmd_cache)
    from llmesh.cli.batches import add_parser as add_batches
    add_batches(sub, _add_layout_args).set_defaults(func=cmd_batches)

    certs = sub.add_parser("certs", help="make the mesh's CA and service certificates (kept if they exist)")
    certs.add_argument("--dir", type=Path, required=True, help="where ca.pem, <instance>.pem and <instance>-key.pem go")
    certs.add_argument("identity", nargs="*", metavar="SERVICE[:INSTANCE]",
                       help="SERVICE: one certificate every replica shares (CN = the service); SERVICE:INSTANCE: "
                            "one instance's own (CN = INSTANCE). Services: gateway, engine, scheduler, modelmgr, "
                            "cache, cli. Default: one shared certificate per service")
    certs.set_defaults(func=cmd_certs)
    return parser


def cmd_certs(args: argparse.Namespace) -> int:
    from llmesh.cli.secure import cmd_certs as certs

    return certs(args.dir, args.identity, sys.stdout)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        raise SystemExit(cmd_bench(argv[1:]))
    args = build_parser().parse_args(argv)
    raise SystemExit(args.func(args))


def cmd_bench(argv: list[str]) -> int:
    """``llmesh bench [NAME] [args]``: ``python -m bench`` in a checkout's bench/ folder,
    which lists the benchmarks (bench/ is not part of the installed package)."""
    import subprocess

    if not (Path.cwd() / "bench" / "__main__.py").is_file():
        print("llmesh bench runs the benchmarks of a checkout of llmesh (its bench/ folder); cd there first",
              file=sys.stderr)
        return 2
    return subprocess.run([sys.executable, "-m", "bench", *argv]).returncode
