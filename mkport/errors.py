"""The one exception type the CLI turns into a one-line message and exit code 2."""


class MkportError(Exception):
    """Bad input or an unsupported model/config: the message names what is wrong and what is supported."""
