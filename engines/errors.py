"""The one exception for bad input from a user or a model file: its message is one sentence naming the
problem and the fix. The CLI prints it as `error: ...` and exits 2; nothing else catches it silently."""


class UserError(Exception):
    """Bad input from the user: the message is one sentence naming the problem and the fix."""
