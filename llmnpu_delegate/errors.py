"""One exception type for problems a user can fix; the CLI prints it as a single line."""


class LlmNpuError(Exception):
    """A bad input or missing piece: the message names the problem and the fix."""
