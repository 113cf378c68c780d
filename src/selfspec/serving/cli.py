"""``selfspec serve``: the command line of the OpenAI-compatible server.

The operator's own ``--method`` options may name files (``--heads PATH``); a request's may
not: they name assets in ``--assets-dir`` (:mod:`selfspec.serving.assets`).
"""

from __future__ import annotations

import argparse
import sys

from selfspec.cli_args import (
    add_model_argument,
    add_prefill_chunk_argument,
    add_threads_argument,
    add_weight_format_arguments,
    float_arg,
    int_arg,
)
from selfspec.serving.config import ServeConfig
from selfspec.serving.protocol import Limits

# The defaults are the dataclasses' that the arguments fill: stated once, there.
_SERVE = ServeConfig(model_name="")
_LIMITS = Limits()


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """Add ``selfspec serve`` to the CLI."""
    from selfspec.methods.cli_options import add_method_arguments

    p = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions, /v1/chat/completions (streaming or not), "
                    "/v1/models, /health and Prometheus /metrics with continuous batching. "
                    "Binds 127.0.0.1 unless --host says otherwise; set --api-key (it guards "
                    "/metrics too) before exposing it.")
    add_model_argument(p)
    p.add_argument("--served-name", default=None,
                   help="the name clients pass as `model` (default: the model's name)")
    add_weight_format_arguments(p)
    p.add_argument("--method", default=_SERVE.method,
                   help="default method, or a bench row's label with its options "
                        "(adadecode:gamma=0.9); a request may override it in its `selfspec` field; "
                        "ar, ngram and auto batch rows together, the others run rows in turn")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int_arg(0, 65535), default=8000)
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (also $SELFSPEC_API_KEY)")
    p.add_argument("--api-keys-file", default=None, metavar="FILE",
                   help="more keys, one 'TENANT KEY' a line (# comments, blank lines skipped), "
                        "read once at start; each key's tenant drafts only from its own "
                        "history (--api-key is tenant 'default')")
    p.add_argument("--tenant-from-user", action="store_true",
                   help="a request's `user` field names a tenant inside its key's")
    p.add_argument("--share-history", action="store_true",
                   help="every tenant drafts from one shared n-gram history: faster drafts, "
                        "but a client can read other clients' texts back from its own timing "
                        "(docs/serving.md, 'Tenants and history')")
    p.add_argument("--max-tenants", type=int_arg(1), default=_SERVE.max_tenants,
                   help=f"tenants' histories kept, least recently used dropped first "
                        f"(default {_SERVE.max_tenants})")
    p.add_argument("--stream-chunk-tokens", type=int_arg(1), default=None, metavar="N",
                   help="stream N tokens a chunk (the last fewer), so chunk sizes do not show "
                        "how many drafts each step accepted (default: each step's tokens)")
    p.add_argument("--max-batch", type=int_arg(1, 256), default=_SERVE.max_batch,
                   help=f"requests decoded together (default {_SERVE.max_batch})")
    p.add_argument("--max-queue", type=int_arg(0), default=_SERVE.max_queue,
                   help=f"requests waiting for a batch row before 429 "
                        f"(default {_SERVE.max_queue})")
    p.add_argument("--max-batch-tokens", type=int_arg(1), default=_SERVE.max_batch_tokens,
                   metavar="N",
                   help="KV positions the running rows may reach together (each: prompt + "
                        "max_tokens); a request that would pass it waits, one larger alone is "
                        "a 400 (default: no bound but --max-batch)")
    p.add_argument("--assets-dir", default=None, metavar="DIR",
                   help="trained assets (head files, skip sets) requests may name in their "
                        "`selfspec` options, by bare name inside DIR (default: none; a request "
                        "naming a file is a 400)")
    p.add_argument("--health-auth", action="store_true",
                   help="/health needs the API key too (default: open, for load balancers)")
    p.add_argument("--drain-seconds", type=float_arg(0), default=_SERVE.drain_seconds,
                   help="on SIGTERM/SIGINT: new requests get 503 while accepted ones finish, "
                        "for at most this long; the rest end with an error "
                        f"(default {_SERVE.drain_seconds:g})")
    p.add_argument("--header-timeout", type=float_arg(0, low_open=True),
                   default=_SERVE.header_timeout, metavar="SECONDS",
                   help="close a connection whose request headers take longer "
                        f"(default {_SERVE.header_timeout:g})")
    p.add_argument("--body-timeout", type=float_arg(0, low_open=True),
                   default=_SERVE.body_timeout, metavar="SECONDS",
                   help="answer 408 and close the connection when a request's body takes "
                        f"longer once its headers are in (default {_SERVE.body_timeout:g})")
    p.add_argument("--max-prompt-tokens", type=int_arg(1), default=_LIMITS.max_prompt_tokens)
    p.add_argument("--max-tokens", type=int_arg(1), default=_LIMITS.max_tokens,
                   help="largest max_tokens a request may ask for")
    p.add_argument("--default-max-tokens", type=int_arg(1), default=_LIMITS.default_max_tokens)
    p.add_argument("--max-body-bytes", type=int_arg(64), default=_LIMITS.max_body_bytes)
    p.add_argument("--prefix-cache-mib", type=int_arg(0), default=256,
                   help="MiB of earlier prompts' KV kept for later prompts that start with the "
                        "same tokens (a chat's system prompt and history): only the rest is "
                        "prefilled; 0 turns it off (default 256)")
    add_prefill_chunk_argument(p)
    add_threads_argument(p, help="torch intra-op threads (of each replica with --ray)")
    add_ray_arguments(p)
    add_method_arguments(p)
    p.set_defaults(func=_cmd_serve)


def add_ray_arguments(p: argparse.ArgumentParser) -> None:
    """``--ray`` and its scaling options (:class:`~selfspec.cluster.options.RayServeOptions`
    states their defaults)."""
    from selfspec.cluster.options import RayServeOptions

    ray = RayServeOptions()
    group = p.add_argument_group("Ray Serve (docs/scale-out.md)")
    group.add_argument("--ray", action="store_true",
                       help="serve as a Ray Serve application: engine replicas behind one "
                            "HTTP entry, requests routed by prompt prefix")
    group.add_argument("--replicas", type=int_arg(1), default=ray.replicas,
                       help=f"engine replicas (default {ray.replicas})")
    group.add_argument("--min-replicas", type=int_arg(1), default=None,
                       help="autoscale from this many replicas (with --max-replicas)")
    group.add_argument("--max-replicas", type=int_arg(1), default=None,
                       help="autoscale up to this many replicas")
    group.add_argument("--target-ongoing-requests", type=float_arg(0, low_open=True),
                       default=None, help="the autoscaler's target of requests in flight per "
                                          "replica (default: --max-batch)")
    group.add_argument("--no-affinity", action="store_true",
                       help="route by load alone (default: requests sharing a prompt prefix "
                            "go to one replica, where its prefix cache and history live)")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (ray start --head's address; default: "
                            "$RAY_ADDRESS, else start a local one)")


def _cmd_serve(args: argparse.Namespace) -> int:
    import torch

    import selfspec
    from selfspec.serving.app import serve

    load, options, api_keys = _checked(args)
    if args.ray:
        return _serve_on_ray(args, *ray_plan(args)[:3])
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    engine = selfspec.load(**load)
    config = _serve_config(args, args.served_name or engine.name, options, api_keys)
    print(f"[selfspec] serving {config.model_name} ({args.method}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    serve(engine, config, host=args.host, port=args.port,
          log_level="debug" if args.debug else "info" if args.verbose else "warning")
    return 0


def _serve_config(args: argparse.Namespace, model_name: str, options: dict,
                  api_keys: dict) -> ServeConfig:
    """The :class:`ServeConfig` of the command line."""
    import os
    from pathlib import Path

    limits = Limits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                    max_tokens=args.max_tokens,
                    default_max_tokens=min(args.default_max_tokens, args.max_tokens))
    return ServeConfig(model_name=model_name, method=args.method, method_options=options,
                       api_key=args.api_key or os.environ.get("SELFSPEC_API_KEY") or None,
                       limits=limits, max_batch=args.max_batch, max_queue=args.max_queue,
                       max_batch_tokens=args.max_batch_tokens,
                       assets_dir=None if args.assets_dir is None else Path(args.assets_dir),
                       health_auth=args.health_auth, drain_seconds=args.drain_seconds,
                       header_timeout=args.header_timeout,
                       body_timeout=args.body_timeout, api_keys=api_keys,
                       tenant_from_user=args.tenant_from_user,
                       share_history=args.share_history, max_tenants=args.max_tenants,
                       stream_chunk_tokens=args.stream_chunk_tokens)


def _checked(args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """The command line checked before a model loads: ``(load, method options, api keys)``
    (``load``: :func:`selfspec.load`'s keyword arguments)."""
    from pathlib import Path

    from selfspec.methods.cli_options import apply_method_spec, method_options
    from selfspec.methods.registry import get_method
    from selfspec.serving.auth import read_keys_file

    apply_method_spec(args)
    if args.assets_dir is not None and not Path(args.assets_dir).is_dir():
        from selfspec.errors import InvalidArgumentError

        raise InvalidArgumentError(f"--assets-dir {args.assets_dir!r} is not a directory")
    options = method_options(args)
    get_method(args.method).parse(options)  # bad options fail before the model loads
    api_keys = {} if args.api_keys_file is None else read_keys_file(args.api_keys_file)
    load = {"model": args.model, "dtype": args.dtype, "decode_kernel": args.decode_kernel,
            "device": args.device, "cuda_graphs": args.cuda_graphs,
            "prefix_cache_mib": args.prefix_cache_mib, "prefill_chunk": args.prefill_chunk}
    return load, options, api_keys


def ray_plan(args: argparse.Namespace):
    """``(load, config, options, application)`` of ``selfspec serve --ray``'s command line:
    what :func:`selfspec.cluster.serve_app.run` takes, and the Ray Serve application itself
    (:func:`selfspec.cluster.serve_app.build_application`) for ``serve run``."""
    from selfspec.cluster import serve_app
    from selfspec.cluster.options import RayServeOptions

    load, method_options, api_keys = _checked(args)
    config = _serve_config(args, args.served_name or "", method_options, api_keys)
    options = RayServeOptions(replicas=args.replicas, min_replicas=args.min_replicas,
                              max_replicas=args.max_replicas,
                              target_ongoing_requests=args.target_ongoing_requests,
                              threads=args.threads or RayServeOptions.threads,
                              affinity=not args.no_affinity, address=args.ray_address)
    return load, config, options, serve_app.build_application(load, config, options)


def _serve_on_ray(args: argparse.Namespace, load: dict, config: ServeConfig,
                  options) -> int:
    from selfspec.cluster import serve_app

    print(f"[selfspec] serving {args.model or 'the default model'} on Ray Serve "
          f"({options.replicas if options.min_replicas is None else 'autoscaled'} replicas) "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    serve_app.run(load, config, options, args.host, args.port)
    return 0
