"""Let a llama.cpp build linked against glibc 2.38 load on an older glibc (Debian 12 has 2.36).

llama-cpp-py-sync's wheels are tagged manylinux2014 but were built on a glibc 2.38 system, whose headers turn
``strtol``, ``strtoul``, ``strtoull`` and ``sscanf`` into their C23 variants ``__isoc23_*`` (which only add
``0b`` binary literals: llama.cpp parses no such text). The loader then refuses the libraries: "version
`GLIBC_2.38' not found". :func:`relink_c23_imports` copies the libraries and, in each copy's dynamic symbol
table, points those imports back at the C99 functions (the tail of the same name string, at version
GLIBC_2.2.5) and marks the GLIBC_2.38 requirement weak. No code changes: llama.cpp's own machine code runs.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

PREFIX = "__isoc23_"
SHT_DYNSYM, SHT_GNU_VERNEED, SHT_GNU_VERSYM = 11, 0x6FFFFFFE, 0x6FFFFFFF
VER_FLG_WEAK = 0x2
SYMBOL_SIZE = 24  # Elf64_Sym


def relink_c23_imports(library_dir: Path, output_dir: Path) -> Path:
    """Copy every ``lib*.so*`` of ``library_dir`` into ``output_dir``, relinked; returns ``output_dir``.

    The copies find each other through their ``$ORIGIN`` run path, so ``output_dir/libllama.so`` loads whole.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    for library in sorted(library_dir.glob("lib*.so*")):
        data = bytearray(library.read_bytes())
        _relink(data)
        (output_dir / library.name).write_bytes(data)
        shutil.copymode(library, output_dir / library.name)
    return output_dir


def _c_string(data: bytearray, offset: int) -> str:
    return data[offset : data.index(b"\0", offset)].decode()


def _sections(data: bytearray) -> dict[int, tuple[int, int, int]]:
    """ELF64 little-endian section headers by type (the dynamic ones are unique): offset, size, link."""
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "an x86-64 shared library"
    (table,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    found: dict[int, tuple[int, int, int]] = {}
    for index in range(count):
        _, kind, _, _, offset, size, link, _, _, _ = struct.unpack_from("<IIQQQQIIQQ", data, table + index * entry_size)
        found.setdefault(kind, (offset, size, link))
    return found


def _libc_versions(data: bytearray, verneed: int, strings: int) -> dict[str, tuple[int, int]]:
    """libc.so.6's required versions: name -> (version index, offset of its Elf64_Vernaux)."""
    versions: dict[str, tuple[int, int]] = {}
    offset = verneed
    while True:
        _, count, file, aux, following = struct.unpack_from("<HHIII", data, offset)
        entry = offset + aux
        for _ in range(count):
            _, _, index, name, next_aux = struct.unpack_from("<IHHII", data, entry)
            if _c_string(data, strings + file) == "libc.so.6":
                versions[_c_string(data, strings + name)] = (index, entry)
            entry += next_aux
        if not following:
            return versions
        offset += following


def _relink(data: bytearray) -> None:
    sections = _sections(data)
    if SHT_DYNSYM not in sections or SHT_GNU_VERNEED not in sections:
        return
    symbols, symbols_size, strings_section = sections[SHT_DYNSYM]
    strings = _sections_by_index(data, strings_section)
    versions = _libc_versions(data, sections[SHT_GNU_VERNEED][0], strings)
    if "GLIBC_2.38" not in versions:
        return
    c23, requirement = versions["GLIBC_2.38"]
    c99 = versions["GLIBC_2.2.5"][0]
    versym = sections[SHT_GNU_VERSYM][0]
    for index in range(symbols_size // SYMBOL_SIZE):
        if struct.unpack_from("<H", data, versym + 2 * index)[0] & 0x7FFF != c23:
            continue
        symbol = symbols + index * SYMBOL_SIZE
        (name,) = struct.unpack_from("<I", data, symbol)
        text = _c_string(data, strings + name)
        if not text.startswith(PREFIX):
            raise ValueError(f"{text} needs glibc 2.38 and has no older equivalent")
        struct.pack_into("<I", data, symbol, name + len(PREFIX))  # "__isoc23_strtol" -> its tail "strtol"
        struct.pack_into("<H", data, versym + 2 * index, c99)
    (flags,) = struct.unpack_from("<H", data, requirement + 4)
    struct.pack_into("<H", data, requirement + 4, flags | VER_FLG_WEAK)  # a weak version may be absent


def _sections_by_index(data: bytearray, index: int) -> int:
    """The file offset of section ``index`` (the string table a symbol table links to)."""
    (table,) = struct.unpack_from("<Q", data, 0x28)
    (entry_size,) = struct.unpack_from("<H", data, 0x3A)
    return int(struct.unpack_from("<Q", data, table + index * entry_size + 24)[0])
