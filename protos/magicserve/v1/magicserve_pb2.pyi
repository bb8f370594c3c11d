from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class ScalePoolRequest(_message.Message):
    __slots__ = ("pool", "instances", "hold", "switch_from")
    POOL_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    SWITCH_FROM_FIELD_NUMBER: _ClassVar[int]
    pool: str
    instances: int
    hold: bool
    switch_from: str
    def __init__(self, pool: _Optional[str] = ..., instances: _Optional[int] = ..., hold: _Optional[bool] = ..., switch_from: _Optional[str] = ...) -> None: ...

class ScalePoolResult(_message.Message):
    __slots__ = ("pool", "desired", "current", "added", "removed", "error", "seconds", "switched", "switch_from", "handed_back")
    POOL_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWITCHED_FIELD_NUMBER: _ClassVar[int]
    SWITCH_FROM_FIELD_NUMBER: _ClassVar[int]
    HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    pool: str
    desired: int
    current: int
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    error: str
    seconds: float
    switched: _containers.RepeatedScalarFieldContainer[str]
    switch_from: str
    handed_back: int
    def __init__(self, pool: _Optional[str] = ..., desired: _Optional[int] = ..., current: _Optional[int] = ..., added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., error: _Optional[str] = ..., seconds: _Optional[float] = ..., switched: _Optional[_Iterable[str]] = ..., switch_from: _Optional[str] = ..., handed_back: _Optional[int] = ...) -> None: ...

class PoolShape(_message.Message):
    __slots__ = ("pool", "current", "desired", "held", "instances")
    POOL_FIELD_NUMBER: _ClassVar[int]
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    DESIRED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    pool: str
    current: int
    desired: int
    held: bool
    instances: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, pool: _Optional[str] = ..., current: _Optional[int] = ..., desired: _Optional[int] = ..., held: _Optional[bool] = ..., instances: _Optional[_Iterable[str]] = ...) -> None: ...

class MigrateRequestRequest(_message.Message):
    __slots__ = ("request_id", "destination", "timeout_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    destination: str
    timeout_s: float
    def __init__(self, request_id: _Optional[str] = ..., destination: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class MigrationResult(_message.Message):
    __slots__ = ("request_id", "source", "destination", "committed", "reason", "seconds", "source_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source: str
    destination: str
    committed: bool
    reason: str
    seconds: float
    source_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., source: _Optional[str] = ..., destination: _Optional[str] = ..., committed: _Optional[bool] = ..., reason: _Optional[str] = ..., seconds: _Optional[float] = ..., source_tokens: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("instance", "undo", "timeout_s")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    UNDO_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    instance: str
    undo: bool
    timeout_s: float
    def __init__(self, instance: _Optional[str] = ..., undo: _Optional[bool] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class DrainResult(_message.Message):
    __slots__ = ("instance", "drained", "migrations", "finished_in_place", "handed_back")
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_IN_PLACE_FIELD_NUMBER: _ClassVar[int]
    HANDED_BACK_FIELD_NUMBER: _ClassVar[int]
    instance: str
    drained: bool
    migrations: _containers.RepeatedCompositeFieldContainer[MigrationResult]
    finished_in_place: int
    handed_back: int
    def __init__(self, instance: _Optional[str] = ..., drained: _Optional[bool] = ..., migrations: _Optional[_Iterable[_Union[MigrationResult, _Mapping]]] = ..., finished_in_place: _Optional[int] = ..., handed_back: _Optional[int] = ...) -> None: ...

class SamplingParameters(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias", "include_stop_str_in_output", "logprobs", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens", "n", "best_of", "json_schema", "json_object", "regex", "choice", "grammar")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    include_stop_str_in_output: bool
    logprobs: int
    prompt_logprobs: int
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    n: int
    best_of: int
    json_schema: str
    json_object: bool
    regex: str
    choice: Choices
    grammar: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., include_stop_str_in_output: _Optional[bool] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("options",)
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, options: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "prompt_token_ids", "sampling", "ttft_target_ms", "tpot_target_ms", "priority", "request_id")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TTFT_TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_TARGET_MS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    prompt_token_ids: TokenIds
    sampling: SamplingParameters
    ttft_target_ms: float
    tpot_target_ms: float
    priority: int
    request_id: str
    def __init__(self, prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParameters, _Mapping]] = ..., ttft_target_ms: _Optional[float] = ..., tpot_target_ms: _Optional[float] = ..., priority: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("token_ids", "text", "index", "logprobs", "finish_reason", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "ttft_ms", "mean_tpot_ms", "draft_tokens", "accepted_draft_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    MEAN_TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    mean_tpot_ms: float
    draft_tokens: int
    accepted_draft_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., mean_tpot_ms: _Optional[float] = ..., draft_tokens: _Optional[int] = ..., accepted_draft_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GenerateFinal(_message.Message):
    __slots__ = ("finish_reason", "usage")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "delta", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: TokenDelta
    final: GenerateFinal
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., final: _Optional[_Union[GenerateFinal, _Mapping]] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "logprobs", "prompt_logprobs", "sequences")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    sequences: _containers.RepeatedCompositeFieldContainer[GeneratedSequence]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., sequences: _Optional[_Iterable[_Union[GeneratedSequence, _Mapping]]] = ...) -> None: ...

class GeneratedSequence(_message.Message):
    __slots__ = ("index", "token_ids", "text", "finish_reason", "logprobs", "cumulative_logprob")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    cumulative_logprob: float
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., cumulative_logprob: _Optional[float] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InstanceStatus(_message.Message):
    __slots__ = ("name", "role", "device", "alive", "queue_length", "running", "free_kv_blocks", "total_kv_blocks", "acceptance_rate", "mean_accepted_length", "tokens_generated", "preemptions", "cached_kv_blocks", "prefix_cache_queries", "prefix_cache_hits", "call_failures", "prefix_cache_tier_hits", "kv_tiers", "local_prefills")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CALL_FAILURES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_TIER_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    device: str
    alive: bool
    queue_length: int
    running: int
    free_kv_blocks: int
    total_kv_blocks: int
    acceptance_rate: float
    mean_accepted_length: float
    tokens_generated: int
    preemptions: int
    cached_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    call_failures: int
    prefix_cache_tier_hits: int
    kv_tiers: _containers.RepeatedCompositeFieldContainer[KVTierStatus]
    local_prefills: int
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., device: _Optional[str] = ..., alive: _Optional[bool] = ..., queue_length: _Optional[int] = ..., running: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., acceptance_rate: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., tokens_generated: _Optional[int] = ..., preemptions: _Optional[int] = ..., cached_kv_blocks: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., call_failures: _Optional[int] = ..., prefix_cache_tier_hits: _Optional[int] = ..., kv_tiers: _Optional[_Iterable[_Union[KVTierStatus, _Mapping]]] = ..., local_prefills: _Optional[int] = ...) -> None: ...

class KVTierStatus(_message.Message):
    __slots__ = ("tier", "hits", "load_bytes", "load_seconds", "stored", "evictions", "corrupt", "blocks", "bytes", "capacity_bytes", "read_ahead", "read_ahead_seconds")
    TIER_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_AHEAD_FIELD_NUMBER: _ClassVar[int]
    READ_AHEAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    hits: int
    load_bytes: int
    load_seconds: float
    stored: int
    evictions: int
    corrupt: int
    blocks: int
    bytes: int
    capacity_bytes: int
    read_ahead: int
    read_ahead_seconds: float
    def __init__(self, tier: _Optional[str] = ..., hits: _Optional[int] = ..., load_bytes: _Optional[int] = ..., load_seconds: _Optional[float] = ..., stored: _Optional[int] = ..., evictions: _Optional[int] = ..., corrupt: _Optional[int] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., read_ahead: _Optional[int] = ..., read_ahead_seconds: _Optional[float] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("instances", "queued_requests", "running_requests", "model", "migrations_committed", "migrations_aborted", "pools", "recent_scaling", "dtype", "dtype_reason", "load_aware_placements", "kv_store_segments", "kv_store_objects")
    INSTANCES_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_ABORTED_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    RECENT_SCALING_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_REASON_FIELD_NUMBER: _ClassVar[int]
    LOAD_AWARE_PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    instances: _containers.RepeatedCompositeFieldContainer[InstanceStatus]
    queued_requests: int
    running_requests: int
    model: str
    migrations_committed: int
    migrations_aborted: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolShape]
    recent_scaling: _containers.RepeatedCompositeFieldContainer[ScalePoolResult]
    dtype: str
    dtype_reason: str
    load_aware_placements: _containers.RepeatedCompositeFieldContainer[PlacementCount]
    kv_store_segments: _containers.RepeatedCompositeFieldContainer[KVStoreSegment]
    kv_store_objects: int
    def __init__(self, instances: _Optional[_Iterable[_Union[InstanceStatus, _Mapping]]] = ..., queued_requests: _Optional[int] = ..., running_requests: _Optional[int] = ..., model: _Optional[str] = ..., migrations_committed: _Optional[int] = ..., migrations_aborted: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolShape, _Mapping]]] = ..., recent_scaling: _Optional[_Iterable[_Union[ScalePoolResult, _Mapping]]] = ..., dtype: _Optional[str] = ..., dtype_reason: _Optional[str] = ..., load_aware_placements: _Optional[_Iterable[_Union[PlacementCount, _Mapping]]] = ..., kv_store_segments: _Optional[_Iterable[_Union[KVStoreSegment, _Mapping]]] = ..., kv_store_objects: _Optional[int] = ...) -> None: ...

class KVStoreSegment(_message.Message):
    __slots__ = ("name", "node", "capacity_bytes", "used_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    node: str
    capacity_bytes: int
    used_bytes: int
    def __init__(self, name: _Optional[str] = ..., node: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...

class PlacementCount(_message.Message):
    __slots__ = ("prefilled_on", "reason", "count")
    PREFILLED_ON_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    prefilled_on: str
    reason: str
    count: int
    def __init__(self, prefilled_on: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class PassLogRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TimedPass(_message.Message):
    __slots__ = ("kind", "end_unix_s", "seconds", "shape_json")
    KIND_FIELD_NUMBER: _ClassVar[int]
    END_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHAPE_JSON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    end_unix_s: float
    seconds: float
    shape_json: str
    def __init__(self, kind: _Optional[str] = ..., end_unix_s: _Optional[float] = ..., seconds: _Optional[float] = ..., shape_json: _Optional[str] = ...) -> None: ...

class InstancePasses(_message.Message):
    __slots__ = ("name", "role", "passes", "dropped")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PASSES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    passes: _containers.RepeatedCompositeFieldContainer[TimedPass]
    dropped: int
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., passes: _Optional[_Iterable[_Union[TimedPass, _Mapping]]] = ..., dropped: _Optional[int] = ...) -> None: ...
