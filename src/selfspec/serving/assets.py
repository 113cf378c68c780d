"""Trained assets (head files, skip sets) as requests may name them: never a path.

A method option that names a file declares it (``option(..., asset=HEAD_FILE)``,
:class:`~selfspec.methods.options.Asset`), so this module covers every such option of every
method without a list of its own. Over HTTP such an option takes only

- a keyword of the option that names no path (``default``: the model's own assets in
  ``$SELFSPEC_HOME``, provisioned by the operator; AdaDecode's ``none``), or
- with ``selfspec serve --assets-dir DIR``, the bare name of an entry of ``DIR`` (no ``/``,
  backslash, ``..``, NUL or control character), which the server resolves inside ``DIR``.

Anything else is a 400 naming the option: a client must never make the server open a path
it names (``/etc/...``, ``../../x``, a file in the server's working directory). The
operator's own ``--method`` options on the command line may still be paths.

A method whose asset is missing is refused before the request is queued
(:func:`missing_asset`), and an asset that fails to load later (for another model, damaged)
is a 400 too (:func:`asset_error`); messages name the option and how the operator provides
the asset, with the server's directories written as ``$SELFSPEC_HOME`` / ``<assets-dir>``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from selfspec.errors import CorruptModelFileError
from selfspec.heads.errors import HeadsModelMismatchError, HeadsNotFoundError
from selfspec.heads.files import DEFAULT, DEFAULT_PROBES, find_head_file
from selfspec.heads.skip_set import HELD_OUT_PREFIX, resolve_skip_set_path
from selfspec.methods.base import MethodSpec
from selfspec.methods.options import OptionField
from selfspec.serving.protocol import ApiError

#: What each kind of asset is, and how a named one is laid out in the assets directory.
_KINDS = {
    "heads": ("trained heads", "NAME/heads.safetensors or NAME.safetensors"),
    "skip_set": ("a searched skip set", "NAME/swift-skip.json or NAME.json"),
}


def asset_fields(spec: MethodSpec) -> list[OptionField]:
    """The options of ``spec`` whose value names a file (declared with ``asset=``)."""
    return [f for f in spec.fields if f.info.asset is not None]


def bad_name(name: str) -> str | None:
    """Why ``name`` is not a bare asset name (``None``: it is one)."""
    if not name or name in (".", ".."):
        return "it is empty or a dot"
    if "\0" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "it holds a NUL or control character"
    if "/" in name or "\\" in name:
        return "it holds a path separator"
    if ".." in name:
        return "it holds '..'"
    return None


def client_options(spec: MethodSpec, values: Mapping[str, Any],
                   assets_dir: Path | None) -> dict[str, Any]:
    """A request's method options with every asset option checked and its bare name
    resolved inside ``assets_dir``.

    Args:
        spec: the request's method.
        values: its options as the request gave them.
        assets_dir: the operator's assets directory (absolute), or ``None``: requests may
            name no asset beyond the options' keywords.

    Raises:
        ApiError: 400 (param ``selfspec``) for a value that is a path, a name with a
            separator, ``..``, NUL or control character, or any name without ``assets_dir``.
    """
    out = dict(values)
    for f in asset_fields(spec):
        value = out.get(f.name)
        # Non-strings are refused by the option's own type check; keywords open no client path.
        if not isinstance(value, str) or value in f.info.asset.keywords:
            continue
        keywords = ", ".join(repr(k) for k in f.info.asset.keywords)
        if assets_dir is None:
            raise ApiError(
                400, f"method {spec.name!r}: option {f.name!r} names a file ({value!r}), and "
                     f"this server takes no file names from requests; use {keywords}, or ask "
                     "the operator to serve named assets (selfspec serve --assets-dir DIR)",
                param="selfspec", code="asset_not_allowed")
        why = bad_name(value)
        if why is not None:
            raise ApiError(
                400, f"method {spec.name!r}: option {f.name!r} must be {keywords} or the bare "
                     f"name of an asset this server provides, not a path ({why}); got {value!r}",
                param="selfspec", code="asset_not_allowed")
        out[f.name] = str(assets_dir / value)
    return out


def missing_asset(spec: MethodSpec, options: Any, model: str,
                  assets_dir: Path | None) -> ApiError | None:
    """A 400 saying which asset ``spec`` with ``options`` (its parsed ``Options``) lacks on
    this server and how to provide it, or ``None`` when every file it reads exists (what it
    reads is :attr:`MethodSpec.heads_files`, as the benchmark's held-out check reads it).
    Only existence is checked here, cheaply, before the request is queued; reading the
    file is the method's build, whose errors :func:`asset_error` maps."""
    for name in spec.heads_files(options):
        skip_set = name.startswith(HELD_OUT_PREFIX)
        value = name[len(HELD_OUT_PREFIX):] if skip_set else name
        path = resolve_skip_set_path(value, model) if skip_set else find_head_file(value, model)
        if path.is_file():
            continue
        kind = "skip_set" if skip_set else "heads"
        fields = asset_fields(spec)
        option = next((f.name for f in fields if str(getattr(options, f.name)) == value),
                      fields[0].name if fields else "heads")
        what, layout = _KINDS[kind]
        shown = value
        if assets_dir is not None and Path(value).parent == assets_dir:
            shown = Path(value).name
        if value == DEFAULT:
            command = ("selfspec heads search-skip" if skip_set else "selfspec heads train")
            how = (f"the model's default ones are not provisioned; the operator makes them with "
                   f"`{command} --model {model}`")
        elif value == DEFAULT_PROBES:
            how = ("the model's default probes are not provisioned; the operator trains them "
                   f"with `selfspec heads train-probe --model {model} --exit-layer E`")
        else:
            how = (f"the server's assets directory has no {shown!r} ({layout}); the operator "
                   "puts it there")
        return ApiError(400, f"method {spec.name!r} needs {what} (option {option!r} = "
                             f"{shown!r}) that this server does not have: {how}",
                        param="selfspec", code="asset_missing")
    return None


def asset_error(error: BaseException, home: Path, assets_dir: Path | None) -> ApiError | None:
    """``error`` as a 400 when it is an asset that cannot be used (not found, for another
    model, damaged), with ``home`` (``$SELFSPEC_HOME``) and ``assets_dir`` not spelled out;
    ``None`` for any other error."""
    if not isinstance(error, (HeadsNotFoundError, HeadsModelMismatchError,
                              CorruptModelFileError)):
        return None
    message = str(error)
    if assets_dir is not None:
        message = message.replace(str(assets_dir), "<assets-dir>")
    message = message.replace(str(home), "$SELFSPEC_HOME")
    return ApiError(400, f"a trained asset of this request's method cannot be used: {message}",
                    param="selfspec", code="asset_unavailable")
