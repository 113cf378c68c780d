"""Errors of the heads package (all derive from :class:`selfspec.errors.SelfSpecError`;
a damaged head file raises the shared :class:`~selfspec.errors.CorruptModelFileError`)."""

from __future__ import annotations

from selfspec.errors import InvalidArgumentError, SelfSpecError


class HeadsModelMismatchError(SelfSpecError):
    """A head file belongs to another model (its fingerprint differs from the loaded model's)."""


class HeadsNotFoundError(SelfSpecError):
    """No head file where one was asked for (e.g. no default heads trained for this model)."""


class NotCalibratedError(InvalidArgumentError):
    """Thresholds were asked of heads that have not been calibrated."""
