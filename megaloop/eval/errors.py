"""Bad input to eval and generate (imported by the command line before torch is)."""


class EvalInputError(ValueError):
    """Bad input to eval/generate; the message is one line saying what is wrong and what to do (exit code 2)."""
