"""Request bodies of the embedded server's routes: SGLang's field names, with size bounds.

SGLang declares these fields without bounds; here every string and list has one, so an
oversized or out-of-range value is refused with HTTP 400 naming the field (pydantic's
message, e.g. ``model_path: String should have at most 4096 characters``) before it
reaches the file system, the network or an error message. The bounds are far above what
a real client sends: PyTorch's longest weight name is about a hundred characters, a host
name at most 253, a path at most ``PATH_MAX``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

__all__ = [
    "AbortBody",
    "DistributedUpdateBody",
    "GenerateBody",
    "InitWeightsGroupBody",
    "MemoryBody",
    "PauseBody",
    "SamplingParamsBody",
    "UpdateFromDiskBody",
    "WeightVersionBody",
]

MAX_PATH_CHARS = 4096  # Linux's PATH_MAX
MAX_HOST_CHARS = 255  # a DNS name has at most 253
MAX_NAME_CHARS = 256  # request ids, group names, weight versions, memory tags
MAX_TENSOR_NAME_CHARS = 1024
MAX_TENSORS = 1 << 16  # per weight bucket
MAX_DIMS = 16  # per tensor shape
MAX_WORLD_SIZE = 1 << 20  # ranks in a weight-update group
MAX_PAYLOAD_CHARS = 4 << 20  # one TP rank's serialized tensor handles (base64)
MAX_STOP_STRINGS = 1024
MAX_STOP_CHARS = 4096
MAX_TOKEN_LIST = 1 << 18  # stop token ids (more than any vocabulary)
MAX_MEMORY_TAGS = 16

Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
TensorName = Annotated[str, Field(min_length=1, max_length=MAX_TENSOR_NAME_CHARS)]
DType = Annotated[str, Field(min_length=1, max_length=32)]
Shape = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_DIMS)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TokenIds = Annotated[list[StrictInt], Field(max_length=MAX_TOKEN_LIST)]
PathText = Annotated[str, Field(max_length=MAX_PATH_CHARS)]
Tags = Annotated[list[Name], Field(max_length=MAX_MEMORY_TAGS)]


class SamplingParamsBody(BaseModel):
    """SGLang's ``sampling_params`` keys (an unknown key is a 400, as SGLang refuses it).

    Ranges are checked by :meth:`~areal.inference.sampling.SamplingParams.verify`,
    SGLang's rules; keys SGLang knows but this server does not implement must keep their
    defaults.
    """

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: TokenIds | None = None
    stop: StopStrings | None = None  # one string is taken as a list of one
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    sampling_seed: int | None = None
    # accepted and without effect here (text formatting, streaming)
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    # SGLang features this server does not have
    n: int = 1
    stop_regex: str | list[str] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    custom_params: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        # SGLang takes a string or a list; a list alone keeps refusals free of union noise
        return [value] if isinstance(value, str) else value

    def unsupported(self) -> str | None:
        """The first set key this server does not implement, if any."""
        if self.n != 1:
            return "n"
        for name in (
            "stop_regex",
            "json_schema",
            "regex",
            "ebnf",
            "structural_tag",
            "custom_params",
            "logit_bias",
        ):
            if getattr(self, name) is not None:
                return name
        return None


class GenerateBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # its length is bounded by the body size cap and the context length (a 400)
    input_ids: list[StrictInt]
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    return_logprob: bool = False
    stream: bool = False
    rid: Name | None = None
    lora_path: PathText | None = None


class PauseBody(BaseModel):
    mode: str = Field("abort", max_length=32)


class AbortBody(BaseModel):
    rid: Name | None = None
    abort_all: bool = False


class WeightVersionBody(BaseModel):
    new_version: Name
    abort_all_requests: bool = True


class UpdateFromDiskBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)
    abort_all_requests: bool = False  # SGLang's default


class InitWeightsGroupBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    master_address: str = Field(min_length=1, max_length=MAX_HOST_CHARS)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=0, le=MAX_WORLD_SIZE)
    world_size: int = Field(ge=1, le=MAX_WORLD_SIZE)
    group_name: str = Field("weight_update_group", min_length=1, max_length=MAX_NAME_CHARS)
    backend: str = Field("nccl", max_length=32)  # SGLang's defaults


class DistributedUpdateBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    names: list[TensorName] = Field(max_length=MAX_TENSORS)
    dtypes: list[DType] = Field(max_length=MAX_TENSORS)
    shapes: list[Shape] = Field(max_length=MAX_TENSORS)
    group_name: str = Field("weight_update_group", min_length=1, max_length=MAX_NAME_CHARS)
    abort_all_requests: bool = False  # SGLang's defaults


class TensorUpdateBody(BaseModel):
    """``/update_weights_from_tensor`` (SGLang's ``UpdateWeightsFromTensorReqInput``)."""

    model_config = ConfigDict(extra="ignore")

    # one base64 ForkingPickler dump per TP rank (see areal.inference.tensor_payloads)
    serialized_named_tensors: list[Annotated[str, Field(max_length=MAX_PAYLOAD_CHARS)]] = Field(
        min_length=1, max_length=MAX_WORLD_SIZE
    )
    load_format: Name | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False  # SGLang's defaults
    weight_version: Name | None = None


class MemoryBody(BaseModel):
    tags: Tags | None = None
