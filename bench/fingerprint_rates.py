"""The boundary fingerprints' rates on a GPU, for the projection's pricing (``--fingerprint-GB-s`` and
``--fingerprint-copy-GB-s`` of bench/pipeline_projection.py): rows of a random K/V cache of a model's shape on the
device, fingerprinted

- in turn (``io.fingerprints.fingerprint_layers``: copied to the host, then hashed): ``fingerprint_GB_s``;
- pending (``io.fingerprints.PendingFingerprints``, as the greedy loop takes them on a GPU): the snapshot's copy to
  page-locked memory queued on the stream, timed to the stream's end (``fingerprint_copy_GB_s``: what a decode
  waits for), then the hashes in the worker thread (``pending_hash_GB_s``).

Each is timed on a second round (the first allocates the page-locked blocks, which the allocator keeps), and the
pending fingerprints must equal those taken in turn.

    python bench/fingerprint_rates.py --layers 48 --kv-heads 8 --head-dim 128 --positions 3327 --rows 4  # 14B
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    import torch

    from stagereplay.io.fingerprints import PendingFingerprints, fingerprint_layers

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--positions", type=int, default=3327)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (1, args.kv_heads, args.positions, args.head_dim)
    rows = [[tuple(torch.randn(shape, generator=gen, device=device).to(getattr(torch, args.dtype)) for _ in "kv")
             for _ in range(args.layers)] for _ in range(args.rows)]
    GB = sum(t.numel() * t.element_size() for row in rows for pair in row for t in pair) / 1e9

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
           "GB": GB, "rows": args.rows, "row_shape": [args.layers, 2, *shape], "dtype": args.dtype}
    for round_ in range(2):
        sync()
        t0 = time.perf_counter()
        serial = [fingerprint_layers(row) for row in rows]
        t_serial = time.perf_counter() - t0
        sync()
        t0 = time.perf_counter()
        pending = [PendingFingerprints(row) for row in rows]
        sync()
        t_copy = time.perf_counter() - t0
        results = [p.result() for p in pending]
        t_all = time.perf_counter() - t0
        if results != serial:
            raise SystemExit("the pending fingerprints differ from those taken in turn")
        del pending, results
    out.update(fingerprint_GB_s=GB / t_serial, fingerprint_copy_GB_s=GB / t_copy,
               pending_hash_GB_s=GB / (t_all - t_copy), pending_equal_serial=True)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
