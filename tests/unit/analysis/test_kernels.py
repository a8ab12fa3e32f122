"""Tests of the kernel taxonomy: token matching and the categories of real kernel names."""

from __future__ import annotations

import pytest

from stepscope.analysis import kernels as K


@pytest.mark.parametrize(
    ("name", "cat", "want"),
    [
        ("ampere_sgemm_128x64_nn", "kernel", K.GEMM),
        ("volta_sgemm_64x64_nt", "kernel", K.GEMM),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "kernel", K.GEMM),
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_NTN", "kernel", K.GEMM),
        ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_128x64_32x6_nt_align1>(P)", "kernel", K.GEMM),
        ("triton_tem_fused_mm_0", "kernel", K.GEMM),
        ("Cijk_Alik_Bljk_SB_Bias_AS_SAV_UserArgs_MT64x16x32_MI16x16x1", "kernel", K.GEMM),
        ("void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 64>>(Flash_fwd_params)", "kernel", K.ATTENTION),
        ("fmha_cutlassF_f32_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<float>)",
         "kernel", K.ATTENTION),
        ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_params>", "kernel",
         K.ATTENTION),
        ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_3", "kernel", K.ATTENTION),
        ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", "kernel",
         K.COMMUNICATION),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", K.COMMUNICATION),
        ("nvshmemi_transfer_rma_kernel", "kernel", K.COMMUNICATION),
        ("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", K.MEMORY),
        ("Memset (Device)", "gpu_memset", K.MEMORY),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", "kernel",
         K.ELEMENTWISE),
        ("triton_poi_fused_add_cos_sin_0", "kernel", K.ELEMENTWISE),
        ("triton_red_fused_sum_1", "kernel", K.REDUCTION),
        ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, MeanOps<float>>>", "kernel",
         K.REDUCTION),
        ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", "kernel",
         K.NORM),
        ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1, true>", "kernel", K.NORM),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<TensorListMetadata<2>>",
         "kernel", K.OPTIMIZER),
        ("fbgemm_gpu::permute_2D_data_kernel<false, int, int>", "kernel", K.ELEMENTWISE),
        ("some_custom_thing", "kernel", K.OTHER),
    ],
)
def test_classify_real_kernel_names(name: str, cat: str, want: str) -> None:
    assert K.classify(name, cat) == want


def test_tokens_not_substrings() -> None:
    # The contract: `mm` must not match `record_param_comms`, nor `nccl` hide inside a word.
    assert K.classify("record_param_comms") == K.OTHER
    assert "mm" not in K.tokens("record_param_comms")
    assert K.classify("commit_summary_kernel") != K.GEMM
    assert K.classify("triton_tem_fused_mm_0") == K.GEMM


def test_multiply_is_not_an_optimizer() -> None:
    assert K.classify("void multiply_kernel<float>") != K.OPTIMIZER


@pytest.mark.parametrize(
    ("name", "kind_arg", "want"),
    [
        ("Memcpy HtoD (Pageable -> Device)", None, "HtoD"),
        ("Memcpy DtoH (Device -> Pinned)", None, "DtoH"),
        ("Memcpy DtoD (Device -> Device)", None, "DtoD"),
        ("Memcpy PtoP (Device -> Device)", None, "PtoP"),
        ("Memset (Device)", None, "Memset"),
        ("Memcpy HtoD (Host -> Device)", "HtoD", "HtoD"),
        ("CopyHostToDevice", "HtoD", "HtoD"),
    ],
)
def test_copy_kind(name: str, kind_arg: str | None, want: str) -> None:
    assert K.copy_kind(name, kind_arg) == want


def test_every_category_has_a_class() -> None:
    assert K.TAXONOMY_VERSION
    for c in K.CATEGORIES:
        assert K.kernel_class(c) in (K.COMPUTE, K.COMM, K.MEM)
    assert K.kernel_class(K.COMMUNICATION) == K.COMM
    assert K.kernel_class(K.MEMORY) == K.MEM
    assert K.kernel_class(K.OTHER) == K.COMPUTE
