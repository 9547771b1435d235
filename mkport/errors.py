"""The one exception type the CLI turns into a one-line message and exit code 2, and the range check every floor
raises it from."""


class MkportError(Exception):
    """Bad input or an unsupported model/config: the message names what is wrong and what is supported."""


def check_range(value: int, option: str, low: int, high: int, unit: str = "") -> int:
    if not low <= value <= high:
        raise MkportError(f"{option} {value}: must be {low}..{high}{unit}")
    return value
