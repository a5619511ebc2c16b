"""Instruction counts of the decode kernels' main loops, from `cuobjdump --dump-sass` text.

For each kernel instantiation matching --match, finds the loops (backward branches) whose body
issues 16-byte global loads (LDG.E.128: the split-K kernel the simt kernel replaced, measured
in bench/NOTES.md as "kernel 1") or 16-byte global->shared copies (LDGSTS.E.BYPASS.128: simt,
"kernel 2", and mma, "kernel 3") and reads nothing coherent (the split combine), keeps the two
smallest (softcap off, softcap on) and prints per iteration: the static count, the count on
the common path (less the rarely taken block that patches the new token's row into shared
memory, STS.128), the opcode classes, and per K/V row (iteration rows given by
--rows-per-iter; simt bf16 D=128: 8, mma: 16).

    cuobjdump --dump-sass build/CMakeFiles/_ffi_cuda.dir/cuda/gqa_decode_simt_bf16.cu.o >s.sass
    python bench/sass_loop.py s.sass --match "GqaDecodeSimtKernel<__nv_bfloat16, 128"
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess

CLASSES = ("FFMA", "FMUL", "FADD", "FMNMX", "MUFU", "SHFL", "LDS", "LDG", "LDGSTS", "STS")


def functions(text: str):
    for chunk in re.split(r"\n\s*Function : ", text)[1:]:
        mangled = chunk.split("\n", 1)[0].strip()
        name = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip()
        ins = [
            (int(a, 16), t.strip())
            for a, t in re.findall(r"/\*([0-9a-f]+)\*/\s+([^;]*?)\s*;", chunk)
        ]
        yield name, ins


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def main_loops(ins):
    where = {a: i for i, (a, _) in enumerate(ins)}
    loops = set()
    for i, (a, t) in enumerate(ins):
        m = re.search(r"\bBRA(?:\.\w+)*\s+0x([0-9a-f]+)", t)
        if not m or "BRA.DIV" in t or int(m.group(1), 16) >= a:
            continue
        body = ins[where[int(m.group(1), 16)] : i + 1]
        ops = [opcode(x) for _, x in body]
        wide = any(o.startswith(("LDGSTS.E.BYPASS.128", "LDG.E.128")) for o in ops)
        if wide and not any("STRONG" in o for o in ops):
            loops.add((body[0][0], a))
    return sorted(loops, key=lambda r: r[1] - r[0])[:2]


def rare_blocks(body):
    """Addresses inside BSSY regions that store to shared memory with STS.128 (the row-L
    patch, taken once per split)."""
    rare = set()
    for i, (_, t) in enumerate(body):
        m = re.match(r"BSSY\s+B\d+,\s+0x([0-9a-f]+)", t)
        if not m:
            continue
        end = int(m.group(1), 16)
        region = [(b, x) for b, x in body[i:] if b < end]
        if any(opcode(x) == "STS.128" for _, x in region):
            rare.update(b for b, _ in region)
    return rare


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sass")
    ap.add_argument("--match", default="GqaDecode")
    ap.add_argument("--rows-per-iter", type=int, default=8)
    args = ap.parse_args()
    for name, ins in functions(open(args.sass).read()):
        short = re.search(r"(GqaDecode\w*Kernel<[^>]*>)", name)
        if not short or args.match not in short.group(1):
            continue
        for lo, hi in main_loops(ins):
            body = [(a, t) for a, t in ins if lo <= a <= hi]
            rare = rare_blocks(body)
            common = [t for a, t in body if a not in rare]
            cls = collections.Counter()
            for t in common:
                op = opcode(t).split(".")[0]
                cls[op if op in CLASSES else "other"] += 1
            print(
                f"{short.group(1)} loop {lo:#x}-{hi:#x}: static {len(body)}, common path "
                f"{len(common)} ({len(common) / args.rows_per_iter:.0f} per row) {dict(cls)}"
            )


if __name__ == "__main__":
    main()
