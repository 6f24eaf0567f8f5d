"""Compares libpipe's outputs with eager PyTorch's: same names, same shapes, values within
rtol = atol = 1e-5. Exits non-zero when they differ.

    python compare_outputs.py GOT.safetensors EXPECTED.safetensors
"""

import sys

import torch
from safetensors.torch import load_file


def main(got_path, expected_path):
    got, expected = load_file(got_path), load_file(expected_path)
    if sorted(got) != sorted(expected):
        print(f"output names differ: libpipe {sorted(got)}, PyTorch {sorted(expected)}")
        return 1
    ok = True
    for name in sorted(expected):
        a, b = got[name], expected[name]
        if a.shape != b.shape:
            print(f"{name}: shape {tuple(a.shape)} from libpipe, {tuple(b.shape)} from PyTorch")
            ok = False
            continue
        diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        match = torch.allclose(a, b, rtol=1e-5, atol=1e-5)
        ok &= match
        print(
            f"{name}: shape {tuple(a.shape)}, max |libpipe - PyTorch| = {diff:.3g} -> "
            f"{'matches PyTorch' if match else 'DIFFERS from PyTorch'}"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: compare_outputs.py GOT.safetensors EXPECTED.safetensors")
    sys.exit(main(*sys.argv[1:]))
