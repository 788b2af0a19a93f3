"""The exceptions anns-lab raises for bad input; the CLI prints them as one clear line."""


class AnnsLabError(Exception):
    """Base of every error that is the user's input, not a bug: the message says what to do."""


class ModelNotAvailable(AnnsLabError):
    """A model name is unknown, its weights are not on this machine, or the device asked for is not."""


class PromptError(AnnsLabError):
    """A prompt source cannot produce the requested tokens."""


class DumpError(AnnsLabError):
    """A dump folder is missing, unfinished, corrupt, or was made with other settings."""


class IndexConfigError(AnnsLabError):
    """An index name, parameter or input array is not acceptable."""


class IndexResultError(AnnsLabError):
    """An index (often a plugin) returned a result that breaks the protocol: the message names it and the rule."""


class DecodeError(AnnsLabError):
    """Bad decode input: mode, task, window, top-k, context."""


class IndexFailed(DecodeError):
    """An index mode's index broke during a decode (its build or search raised): that mode fails on the sample, the
    run's other modes go on (an index breaking the result protocol is an :class:`IndexResultError`, handled alike)."""


class ExecutorLost(AnnsLabError):
    """What runs the work is gone for good (a Ray cluster's head): the run stops, keeping what finished."""


class FolderBusy(AnnsLabError):
    """Another process is writing into the folder a dump or sweep would write into (``io.sole_writer``)."""


class ErrorText(str):
    """:func:`error_text`'s line, with ``trace``: the error's traceback, which a failed sweep part's record keeps (a
    plugin's IndexError deep in its build said nothing of where). Pickles with it, to and from worker processes."""

    trace: str = ""


def error_text(err: BaseException) -> ErrorText:
    """One line for an index's (often a plugin's) error: an anns-lab error as it is (it names the index), another with
    its type; SystemExit gets a word, since its message alone is only a code."""
    import traceback

    if isinstance(err, SystemExit):
        text = f"SystemExit({err.code!r}): the index tried to end the process"
    else:
        text = str(err) if isinstance(err, AnnsLabError) else f"{type(err).__name__}: {err}"
    line = ErrorText(text)
    line.trace = "".join(traceback.format_exception(err))
    return line
