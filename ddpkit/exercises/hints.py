"""The hints each exercise reveals on demand, weakest first (``ddpkit.exercises.hint(name, level)``)."""

HINTS = {
    'sampler': [
        'Compute the epoch and the offset inside it from the consumed count with divmod.',
        'Shuffle with torch.randperm and a torch.Generator seeded with seed + epoch, never the global RNG.',
        'Rank r takes order[offset + r : samples_per_epoch : world_size].',
    ],
    'train_step': [
        '`with ddp_model.no_sync():` must hold the forward as well as the backward.',
        "Divide each micro-batch's loss by len(micro_batches) before backward.",
        'scaler.unscale_(optimizer), then clip_grad_norm_, then scaler.step(optimizer) and scaler.update().',
    ],
    'checkpoint': [
        'Never write to the final name: write a temporary file in the same folder first.',
        'os.replace(tmp, final) is atomic on POSIX; fsync the file before it.',
        'load_fn only considers final names, newest step first.',
    ],
    'ring_all_reduce': [
        'torch.tensor_split(tensor, world) gives N views, even when the length does not divide.',
        'In reduce-scatter step s, rank r sends chunk (r - s) mod N and receives chunk (r - s - 1) mod N.',
        'Post each step\'s send and receive together, in one dist.batch_isend_irecv (one NCCL group), or order them '
        'by parity (even ranks send then receive, odd ranks receive then send): a send may wait for its receive, as '
        'on NCCL, so if every rank sends first, every rank waits.',
    ],
    'zero1': [
        'Flatten all parameters into one vector and pad it to a multiple of the world size.',
        'dist.reduce_scatter_tensor(shard, padded_grads) then divide by the world size.',
        'After the inner AdamW step, dist.all_gather_into_tensor and copy back into every parameter.',
    ],
    'config_digest': [
        'Serialise the config to text first, the same way every time.',
        'json.dumps(config, sort_keys=True) makes the key order irrelevant.',
        'hashlib.sha256(text.encode()).hexdigest() is stable across processes; hash() is not.',
    ],
    'broadcast_parameters': [
        'dist.broadcast(tensor, src=0) overwrites tensor on every rank but rank 0.',
        'Loop over model.parameters() on every rank, in the same order.',
        'Use p.data (or torch.no_grad()) so that autograd does not record the copy.',
    ],
    'global_mean_loss': [
        'You need two global numbers: the total loss and the total count.',
        'Put both in one tensor and all-reduce it once.',
        'Divide after the all-reduce, not before.',
    ],
    'f_and_g': [
        'Write each as a torch.autograd.Function with a forward and a backward staticmethod.',
        'f: forward returns x unchanged; backward all-reduces the gradient.',
        'g: forward all-reduces a clone of x; backward returns the gradient unchanged.',
    ],
    'one_f_one_b': [
        'Stage s starts with p - s - 1 forwards (a warm-up).',
        'Then alternate: the next forward, then the oldest backward still to do.',
        'End with the backwards left over.',
    ],
    'interleaved_order': [
        'Rank r holds chunks r, r + p, ...: its forwards take a round of micro-batches through its first chunk, '
        'then the same round through its next chunk (torch: rounds of m // max(1, m // p)).',
        'Before its first backward, a rank runs one round through each chunk but its last, plus 2 (p - 1 - r) '
        'forwards; then one forward, one backward; then the backwards left.',
        "Backwards take the rank's chunks last to first, a round per chunk: micro-batch 0's gradient starts at the "
        "model's last chunk.",
    ],
    'should_stop': [
        "Every rank must reach the same answer without knowing the others' flags: that needs a collective.",
        'Put the flag in a tensor.',
        'dist.all_reduce(flag, op=dist.ReduceOp.MAX).',
    ],
    'state_bytes': [
        'Write down, per kind of state, whether each stage shards it.',
        "fp32: 4 bytes per weight, 4 per gradient, 8 per parameter for Adam's two moments.",
        'A shard has math.ceil(params / world) elements.',
    ],
    'load_shard': [
        'The old shards, concatenated in rank order, are the vector plus some zeros at the end.',
        'Cut at numel before anything else.',
        "Pad to ceil(numel / world) x world and take this rank's slice.",
    ],
    'same_everywhere': [
        'Summaries (norm, sum) can be equal for different tensors: use the bytes.',
        'hashlib.sha256 over p.detach().cpu().numpy().tobytes() for every parameter.',
        'dist.all_gather_object gives every rank every hash.',
    ],
    'ddp_from_scratch': [
        'Naive: at construction dist.broadcast every parameter from rank 0; in finish(), all-reduce each p.grad that exists and divide by the world size.',
        'Overlap: p.register_post_accumulate_grad_hook(fn) tells you when p.grad is final; start dist.all_reduce(p.grad, async_op=True) there and keep the work; finish() waits.',
        "Buckets: group parameters in reverse order until a group holds bucket_bytes; when a bucket's last gradient arrives, flatten it, divide, start one all-reduce; finish() waits and copies back.",
    ],
    'fsdp_from_scratch': [
        'Flatten, pad to a multiple of the world size, keep your slice as an nn.Parameter.',
        "In forward: dist.all_gather_into_tensor, then point each parameter's .data at its slice (remember the shapes first).",
        'In finish: flatten the gradients, dist.reduce_scatter_tensor, divide by the world size, then free (p.data = torch.empty(0)).',
    ],
    'rank_wiring': [
        'Every value in env is a string: convert with int().',
        'The GPU index is the local rank, not the global rank.',
        'Use a GPU only if gpus_on_node >= LOCAL_WORLD_SIZE.',
    ],
    'attend_block': [
        "A block's own attention is softmax(q k^T / sqrt(D)) v; its log-denominator is torch.logsumexp of the scores.",
        'Over two key sets the denominator is e^lse1 + e^lse2: torch.logaddexp(lse1, lse2) gives its log.',
        'Scale each partial output by exp(its lse - the new lse) (unsqueeze(-1) to broadcast), then add them.',
    ],
    'dispatch': [
        'Two all-to-alls: first the counts (so every receiver can size its buffer), then the rows.',
        'dist.all_to_all_single(out, counts) sends counts[j*E/N:(j+1)*E/N] to rank j: exactly its experts\' counts.',
        'input_split_sizes = counts.view(N, -1).sum(1); output_split_sizes = the received counts summed per source.',
    ],
    'held_between': [
        'Two parts: the shards (always there: the optimizer steps on them) and the gathered whole parameters.',
        'torch.chunk(10 rows, 3) gives 4, 4, 2: rank r keeps max(0, min(ceil(rows/world), rows - r*ceil(rows/world))) rows.',
        'reshard_after_forward=True frees the gathered parameters after forward; False keeps them until backward.',
    ],
    'culprit': [
        'Group every rank\'s entries by collective_seq_id: the same number is the same call on every rank.',
        'At each number compare (profiling_name, input_sizes, input_dtypes) across ranks; a rank with no entry differs too.',
        'At the first number that differs, the culprit is the rank that disagrees with the majority, not with rank 0.',
    ],
    'fed_the_same': [
        'A rank alone cannot see a repeat across ranks: every rank needs every rank\'s ids (dist.all_gather_object).',
        'Ranks may hold different numbers of ids: gather Python lists, or gather the lengths first and pad.',
        'Count each id over all ranks; any count above 1 means True, and every rank computes the same answer.',
    ],
}
