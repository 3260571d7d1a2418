"""The input pipeline's error type."""

from jaxshare.exit_codes import InputError


class DataError(InputError, ValueError):
  """Missing, empty, binary, unreadable or malformed input data; the message says what was expected."""
