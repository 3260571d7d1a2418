"""The input pipeline's error type."""


class DataError(ValueError):
  """Missing, empty, binary, unreadable or malformed input data; the message says what was expected."""
