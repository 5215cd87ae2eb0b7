"""axolotl configs as Ferry specs: `convert_axolotl` (convert.py), the data (data.py) and LoRA (lora.py) sections,
the typed reader that remembers each key read (reader.py), why a key is not converted (keys.py), and the
result, serialized and read back (conversion.py)."""

from jobs.convert.axolotl.conversion import AxolotlConversion
from jobs.convert.axolotl.convert import convert_axolotl

__all__ = ["AxolotlConversion", "convert_axolotl"]
