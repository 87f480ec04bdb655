"""Split a GGUF file into parts the way llama.cpp's `llama-gguf-split --split` does.

Part i (0-based) is `{prefix}-{i+1:05d}-of-{n:05d}.gguf`: the first part carries all metadata,
then every part gets split.no (u16), split.count (u16) and split.tensors.count (i32), and its
own share of the tensors, in file order. `keys` and `chunks` let a test write broken sets.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys

def split_gguf(src: str | Path, folder: str | Path, prefix: str, n_parts: int, *,
               chunks: list[list[str]] | None = None,
               keys: dict[int, dict[str, int | None]] | None = None) -> list[Path]:
    """Write `src` as `n_parts` files in `folder`; returns their paths, first part first.
    `chunks`: the tensor names of each part (default: the tensors cut into n_parts runs).
    `keys`: per part, split.* values to write instead (None leaves the key out)."""
    reader = GGUFReader(str(src))
    by_name = {t.name: t for t in reader.tensors}
    if chunks is None:
        chunks = [list(c) for c in np.array_split(np.array(list(by_name)), n_parts)]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arch = str(reader.fields[Keys.General.ARCHITECTURE].contents())
    total = sum(len(c) for c in chunks)
    paths = []
    for i, names in enumerate(chunks):
        path = folder / f"{prefix}-{i + 1:05d}-of-{n_parts:05d}.gguf"
        w = GGUFWriter(str(path), arch)
        if i == 0:
            for field in reader.fields.values():
                if field.name.startswith("GGUF.") or field.name == Keys.General.ARCHITECTURE:
                    continue  # the reader's view of the header; the writer adds the architecture
                vtype = field.types[0]
                sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
                w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
        else:
            w.kv_data[0].pop(Keys.General.ARCHITECTURE, None)  # gguf-split copies no metadata here
        wanted = {"split.no": i, "split.count": n_parts, "split.tensors.count": total}
        wanted.update((keys or {}).get(i, {}))
        for key, value in wanted.items():
            if value is None:
                continue
            vtype = GGUFValueType.INT32 if key == "split.tensors.count" else GGUFValueType.UINT16
            w.add_key_value(key, value, vtype)
        for name in names:
            t = by_name[name]
            w.add_tensor(name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        paths.append(path)
    return paths
