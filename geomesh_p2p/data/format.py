"""What every reader of training text shares (the local files of :mod:`.corpus` and the datasets of
:mod:`.hub`): the error they raise and the separator between documents."""

__all__ = ["DataError", "DataTooShortError", "DOC_SEPARATOR"]

#: Separator put between documents of a .jsonl / .parquet file or a dataset's rows.
DOC_SEPARATOR = "\n\n"


class DataError(ValueError):
    """A data file is missing, unreadable or in an unsupported format.

    The message is one line and names the offending path.
    """


class DataTooShortError(DataError):
    """The data holds fewer tokens than one sequence of ``seq_len`` in its train or its eval split (a bad input,
    as a bad file is: ``geomesh-peer join`` exits 2)."""
