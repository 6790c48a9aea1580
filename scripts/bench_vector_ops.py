"""What this CPU's vector pipes give the 8-bit kernel's inner step, in cycles: the ceiling
that `scripts/bench_int8_products.py`'s figures are held against (docs/performance.md).

    .venv/bin/python scripts/bench_vector_ops.py

The 8-bit activation kernel (app/models/int8_products.py) spends a product's time, on AVX2
without VNNI, on three instructions for every 32 multiply-adds: a broadcast of 4 of x's bytes,
`vpmaddubsw` against 8 outputs' 4 codes, and a 16-bit add into the block's running sum. Each
line below times one pattern in a loop of inline assembly (x86-64 with AVX2 only), compiled
with llvmlite as the kernel is, against a chain of dependent integer adds (one a cycle) that
measures the clock; independent chains, operands in registers or in the L1 cache, so it is
the pipes that are timed, not the memory.
"""

from __future__ import annotations

import ctypes
import platform
import sys
import time

import llvmlite.binding as llvm

# name: (assembly of one group, the groups in it). %0 holds a 4 KiB buffer's address.
_CLOCK = ("add $$1, %rax\n" * 8, 8)
_PATTERNS = {
    "vpmaddubsw, registers": ("".join(f"vpmaddubsw %ymm14, %ymm15, %ymm{k}\n" for k in range(8)), 8),
    "vpaddw": ("".join(f"vpaddw %ymm14, %ymm{k}, %ymm{k}\n" for k in range(8)), 8),
    "vpbroadcastd from memory": ("".join(f"vpbroadcastd {4 * k}($0), %ymm{k}\n" for k in range(8)), 8),
    "vfmadd231ps": ("".join(f"vfmadd231ps %ymm14, %ymm15, %ymm{k}\n" for k in range(10)), 10),
    # the kernel's step: broadcast x, multiply by the codes, add into one of 4 running sums
    "broadcast + vpmaddubsw + vpaddw": ("".join(
        f"vpbroadcastd {4 * k}($0), %ymm{k}\nvpmaddubsw %ymm{k}, %ymm15, %ymm{k}\n"
        f"vpaddw %ymm{k}, %ymm{8 + k % 4}, %ymm{8 + k % 4}\n" for k in range(8)), 8),
    # the same with x already broadcast in memory (8 times x's bytes)
    "vpmaddubsw from memory + vpaddw": ("".join(
        f"vpmaddubsw {32 * k}($0), %ymm15, %ymm{k}\nvpaddw %ymm{k}, %ymm{8 + k % 4}, %ymm{8 + k % 4}\n"
        for k in range(8)), 8),
}
_CLOBBERS = ",".join(["~{rax}", *(f"~{{ymm{k}}}" for k in range(16)), "~{memory}"])


def _ir(name: str, body: str) -> str:
    asm = body.replace("\n", "\\0A")
    return f"""
define void @{name}(ptr %buf, i64 %n) {{
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%in, %loop]
  call void asm sideeffect "{asm}", "r,{_CLOBBERS}"(ptr %buf)
  %in = add i64 %i, 1
  %more = icmp ult i64 %in, %n
  br i1 %more, label %loop, label %done
done:
  ret void
}}"""


def main() -> int:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        print("These patterns are x86-64 assembly; nothing to time here.")
        return 1
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    llvm.initialize_native_asmparser()
    features = llvm.get_host_cpu_features()
    if not features.get("avx2"):
        print("This CPU has no AVX2.")
        return 1
    cases = {"clock": _CLOCK, **_PATTERNS}
    names = {case: f"f{i}" for i, case in enumerate(cases)}
    module = llvm.parse_assembly("\n".join(_ir(names[c], body) for c, (body, _) in cases.items()))
    machine = llvm.Target.from_default_triple().create_target_machine(
        cpu=llvm.get_host_cpu_name(), features=features.flatten(), opt=2)
    engine = llvm.create_mcjit_compiler(module, machine)
    engine.finalize_object()
    buf = (ctypes.c_uint8 * 4096)(*[(7 * i) & 0x7F for i in range(4096)])
    fns = {c: ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64)(engine.get_function_address(names[c]))
           for c in cases}

    def seconds_per_group(case: str, loops: int = 2_000_000) -> float:
        fn, groups = fns[case], cases[case][1]
        fn(ctypes.addressof(buf), 10_000)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            fn(ctypes.addressof(buf), loops)
            best = min(best, time.perf_counter() - start)
        return best / (loops * groups)

    cycle = seconds_per_group("clock")
    print(f"{llvm.get_host_cpu_name()}, one thread, ~{1e-9 / cycle:.2f} GHz by a chain of adds")
    for case in _PATTERNS:
        cycles = seconds_per_group(case) / cycle
        print(f"  {case:34s} {cycles:5.2f} cycles each ({1 / cycles:.1f} a cycle)")
    print("The kernel's step (32 multiply-adds, one row): broadcast + vpmaddubsw + vpaddw.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
