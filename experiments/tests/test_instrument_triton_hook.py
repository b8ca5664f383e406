"""CPU CI: the Triton stages hook instruments kernels compiled after install(), in a cache of its own, so a
cubin cached without probes is never reused for an instrumented compile (Triton 3.6's key ignores the hook)
and an instrumented one never poisons uninstrumented runs."""

from __future__ import annotations

from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton not installed")

from concordia_lab.instrument import SafepointOptions, triton_hook  # noqa: E402
from instrument_kernels import compile_for_sm90  # noqa: E402


def test_hook_instruments_only_inside_its_own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from triton import knobs

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "plain"))
    plain = compile_for_sm90("layernorm")  # cached in 'plain' without probes
    assert "cft_ctl_" not in plain.asm["ptx"]
    d = triton_hook.install(SafepointOptions(barrier_probes=True, protocol=4), cache_dir=tmp_path / "instrumented")
    try:
        assert knobs.cache.dir == str(d)
        inst = compile_for_sm90("layernorm")  # same source, same Triton key: must not come from 'plain'
        assert "cft_ctl_layernorm_kernel" in inst.asm["ptx"]
        rep = triton_hook.report("layernorm_kernel")
        assert rep is not None and rep.instrumented and rep.barrier_probes > 0
        refused = compile_for_sm90("grid_barrier")
        assert "cft_ctl_" not in refused.asm["ptx"]
        assert triton_hook.report("grid_barrier_kernel").refused == "spin_wait"
    finally:
        triton_hook.uninstall()
    assert knobs.cache.dir == str(tmp_path / "plain")
    again = compile_for_sm90("layernorm")
    assert "cft_ctl_" not in again.asm["ptx"]  # the instrumented cubin did not poison the plain cache


def test_cache_dir_is_salted_by_options() -> None:
    a = triton_hook.default_cache_dir(SafepointOptions())
    b = triton_hook.default_cache_dir(SafepointOptions(protocol=4))
    assert a != b and a == triton_hook.default_cache_dir(SafepointOptions())


def test_hook_refuses_pdl_from_compile_options(tmp_path: Path) -> None:
    triton_hook.install(cache_dir=tmp_path / "i")
    try:
        k = compile_for_sm90("softmax", launch_pdl=True)
        assert "cft_ctl_" not in k.asm["ptx"]
        assert triton_hook.report("softmax_kernel").refused == "pdl"
    finally:
        triton_hook.uninstall()


def test_suspended_compiles_the_plain_baseline_then_instruments_again(tmp_path: Path) -> None:
    triton_hook.install(cache_dir=tmp_path / "i")
    try:
        with triton_hook.suspended():
            assert "cft_ctl_" not in compile_for_sm90("softmax", num_warps=2).asm["ptx"]
        assert "cft_ctl_" in compile_for_sm90("softmax", num_warps=2).asm["ptx"]
    finally:
        triton_hook.uninstall()


def test_header_arg_marks_the_kernel_for_the_profile_allocator_and_reads_its_last_parameter(tmp_path: Path) -> None:
    """SafepointOptions(header_arg=True): the compiled metadata asks Triton's launcher for profile scratch with our
    marker alignment, the probes read the kernel's last parameter (Triton's profile-scratch pointer), and the
    allocator installed beside the hook answers that request; uninstall puts Triton's own allocator back."""
    from triton.runtime import _allocation

    from concordia_lab.instrument import header_arg
    from concordia_lab.instrument.ptxas import assemble

    before = _allocation._profile_allocator.get()
    triton_hook.install(SafepointOptions(header_arg=True), cache_dir=tmp_path / "h")
    try:
        assert header_arg.installed()
        k = compile_for_sm90("poi_silu_mul")
        md = k.metadata
        assert (md.profile_scratch_size, md.profile_scratch_align) == (header_arg.HARG_SIZE, header_arg.route_of(k.hash))
        ptx = k.asm["ptx"]
        params = [ln.split()[-1].rstrip(",") for ln in ptx.splitlines() if ln.strip().startswith(".param")]
        assert f"ld.param.u64 \t%cft_rd0, [{params[-1]}];" in ptx
        assert "cft_harg_poi_silu_mul_kernel" in ptx and "ld.global.u64 \t%cft_rd1, [cft_ctl_poi_silu_mul_kernel]" in ptx
        assert assemble(ptx).spill_bytes == {"poi_silu_mul_kernel": 0}
        refused = compile_for_sm90("grid_barrier")  # a refused kernel asks for nothing
        assert refused.metadata.profile_scratch_size == 0 and "cft_" not in refused.asm["ptx"]
        alloc = _allocation._profile_allocator.get()
        assert alloc(64, md.profile_scratch_align, None) is None  # nothing armed: a null header, nothing read
        other = compile_for_sm90("softmax")  # another kernel, another route
        assert header_arg.is_route(other.metadata.profile_scratch_align)
        assert other.metadata.profile_scratch_align != md.profile_scratch_align
    finally:
        triton_hook.uninstall()
    assert _allocation._profile_allocator.get() is before
    assert not header_arg.installed()


def test_install_without_options_routes_the_header_through_the_kernel_parameter(tmp_path: Path) -> None:
    """install() with no options is header_arg (DESIGN.md §6i): the kernel reads its header from its last
    parameter, the module declares nothing in the constant bank, and the profile allocator is ours until
    uninstall."""
    from concordia_lab.instrument import header_arg

    triton_hook.install(cache_dir=tmp_path / "n")
    try:
        assert header_arg.installed()
        k = compile_for_sm90("poi_silu_mul")
        ptx = k.asm["ptx"]
        assert k.metadata.profile_scratch_size == header_arg.HARG_SIZE
        assert "cft_harg_poi_silu_mul_kernel" in ptx and ".visible .const" not in ptx
    finally:
        triton_hook.uninstall()
    assert not header_arg.installed()


def test_without_header_arg_no_kernel_asks_for_profile_scratch(tmp_path: Path) -> None:
    triton_hook.install(SafepointOptions(), cache_dir=tmp_path / "d")
    try:
        k = compile_for_sm90("poi_silu_mul")
        assert k.metadata.profile_scratch_size == 0 and "cft_harg_" not in k.asm["ptx"]
        assert "ld.const.u64 \t%cft_rd0, [cft_ctl_poi_silu_mul_kernel]" in k.asm["ptx"]
    finally:
        triton_hook.uninstall()


def test_header_arg_leaves_a_kernel_whose_profile_scratch_a_profiler_uses_on_the_constant_bank_pointer(
        tmp_path: Path) -> None:
    """A stages hook installed before ours (as Proton's instrumentation is) gives the kernel profile scratch of its
    own: that kernel keeps the constant-bank pointer and the profiler's size and alignment; the next kernel,
    compiled without it, takes its header from the parameter."""
    from triton import knobs

    prev = knobs.runtime.add_stages_inspection_hook

    def profiler_like(backend, stages, options, language, capability):  # noqa: ANN001, ANN202
        if prev is not None:
            prev(backend, stages, options, language, capability)
        make_llir = stages["llir"]

        def llir(src, metadata):  # noqa: ANN001, ANN202
            out = make_llir(src, metadata)
            metadata["profile_scratch_size"], metadata["profile_scratch_align"] = 256, 128
            return out

        stages["llir"] = llir

    knobs.runtime.add_stages_inspection_hook = profiler_like
    try:
        triton_hook.install(SafepointOptions(header_arg=True), cache_dir=tmp_path / "p")
        try:
            k = compile_for_sm90("poi_silu_mul")
            assert (k.metadata.profile_scratch_size, k.metadata.profile_scratch_align) == (256, 128)
            ptx = k.asm["ptx"]
            assert "cft_harg_" not in ptx and "ld.const.u64 \t%cft_rd0, [cft_ctl_poi_silu_mul_kernel]" in ptx
        finally:
            triton_hook.uninstall()
    finally:
        knobs.runtime.add_stages_inspection_hook = prev
    triton_hook.install(SafepointOptions(header_arg=True), cache_dir=tmp_path / "q")
    try:
        k = compile_for_sm90("poi_silu_mul")
        assert "cft_harg_poi_silu_mul_kernel" in k.asm["ptx"] and k.metadata.profile_scratch_size == 1
    finally:
        triton_hook.uninstall()
