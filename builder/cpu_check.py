"""The build's check of its CPU packages against what the runtime relies on (see `cpu_build`).

On random prompts of the target's vocabulary, one cache size:
- target: for every row count from 2 up, each row is bit-identical (logits, last hidden, taps)
  to the one-row step at the same position (`rows_bit_identical`); a draft tree's rows in one
  call are bit-identical to a chain verify of each leaf's path, and the accepted path's K/V kept
  in place give the next step the chain's bits (`tree_rows_bit_identical`); the
  logits are within `max_abs_diff_vs_eager` of the eager model's;
- MTP head: its package's logits and outputs, for several sequences run together, against the
  eager head's for each sequence alone;
- drafters: the drafts a package proposes for several sequences at once (context fed from the
  target's real taps, blocks of γ and of 4) against the eager drafter's (`drafts_equal`, the
  share of equal tokens: a near-tie may break the other way under another summation order, but
  no more than that) and the package's for each sequence alone (`batched_equal_alone`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from metrale.runtime.components import Role, kind_named


def _packages(root, jobs, name):
    from metrale.runtime.backends.aoti import Package
    from metrale.runtime.backends.aoti_native import load_runner

    out = []
    for j in jobs:
        if j.name == name:  # every package is batched; the target's and the head's take any row count
            out.append(Package(j.rows, load_runner(root / j.rel),
                               kind_named(j.kind).role is not Role.DRAFTER, batched=True))
    return out


def _outputs(outs) -> dict[str, torch.Tensor]:
    """The rows of target outputs, joined: logits, last hidden and taps [T, ·]."""
    return {f: torch.cat([getattr(o, f)[0] for o in outs]) for f in ("logits", "last_hidden", "taps")
            if getattr(outs[0], f) is not None}


def _check_tree(face, gen) -> bool:
    """A random draft tree of 24 drafts verified in one call after a prompt (beside another
    sequence's prompt and a plain step) against a chain verify of each leaf's path after the same
    prompt, row by row; then the deepest leaf's path kept (`keep_path`), the next step's rows
    against the chain's next step."""
    from metrale.runtime.spec.ddtree import Tree
    from metrale.runtime.steps import Forward

    vocab, taps = face.config.vocab_size, face.taps
    parents, depths = [-1], [0]
    for i in range(1, 25):
        parents.append(int(torch.randint(0, i, (1,), generator=gen)))
        depths.append(depths[parents[-1]] + 1)
    tree = Tree(tuple(torch.randint(0, vocab, (25,), generator=gen).tolist()), tuple(parents), tuple(depths))
    prompt, other = (torch.randint(0, vocab, (1, n), generator=gen) for n in (13, 6))
    cache, beside = face.new_cache(1, 48), face.new_cache(1, 48)
    face.forward_many([Forward(prompt, cache, taps), Forward(other, beside, taps)])
    rows = _outputs(face.forward_many([Forward(list(tree.tokens), cache, taps, tree=tree),
                                        Forward(other[0, :1].tolist(), beside, taps)])[:1])
    same = True
    leaves = [i for i in range(25) if i not in parents]
    for leaf in leaves:
        path = [leaf]
        while path[-1] > 0:
            path.append(parents[path[-1]])
        path = path[::-1]
        chain = face.new_cache(1, 48)
        face(prompt, chain)
        want = _outputs([face(torch.tensor([[tree.tokens[n] for n in path]]), chain, taps=taps)])
        same = same and all(torch.equal(rows[f][path], want[f]) for f in want)
        if leaf == max(leaves, key=lambda i: depths[i]):
            cache.keep_path(13, path[1:])
            nxt = torch.tensor([[tree.tokens[leaf]]])
            same = same and cache.length == chain.length and all(
                torch.equal(a, b) for a, b in zip(_outputs([face(nxt, cache, taps=taps)]).values(),
                                                  _outputs([face(nxt, chain, taps=taps)]).values()))
    return same


def _check_batched(together, gen) -> bool:
    """Every row of calls over several sequences (a prefill, a verify, plain steps, each
    sequence's rows chunked differently) equals the same sequence's rows run alone, and each
    sequence's k-row step equals its k one-row steps."""
    from metrale.runtime.backends.aoti_batched import BatchedTarget
    from metrale.runtime.steps import Forward

    target, taps = together.model_ref, together.taps
    ids = torch.randint(0, target.config.vocab_size, (5, 40), generator=gen)
    lengths = (48, 48, 48, 48, 100)  # the last sequence's cache lies in another pool
    caches = [together.new_cache(1, n) for n in lengths]
    splits = [[11, 1, 3, 8, 1], [1] * 24, [7, 7, 7, 3], [24], [2, 9, 13]]
    got = [[] for _ in ids]
    # sequences advance through their own splits; each call takes every sequence's next chunk
    done = [0] * len(ids)
    for step in range(max(len(s) for s in splits)):
        forwards, who = [], []
        for b, split in enumerate(splits):
            if step < len(split):
                forwards.append(Forward(ids[b:b + 1, done[b]:done[b] + split[step]], caches[b], tuple(taps)))
                who.append(b)
                done[b] += split[step]
        for b, out in zip(who, together.forward_many(forwards)):
            got[b].append(out)
    same = True
    for b in range(len(ids)):
        alone = BatchedTarget(target, together.package, taps, together.max_slots, hides=together.hides)
        cache = alone.new_cache(1, lengths[b])
        singles = [alone(ids[b:b + 1, i:i + 1], cache, taps=taps) for i in range(done[b])]
        for field in ("logits", "last_hidden", "taps"):
            if getattr(singles[0], field) is not None:
                want = torch.cat([getattr(o, field) for o in singles], 1)
                same = same and torch.equal(torch.cat([getattr(o, field) for o in got[b]], 1), want)
    return same


def _check_target(root, jobs, staged, taps, slots, gen) -> dict:
    from metrale.runtime.backends.aoti import CompiledTarget

    target = staged.target
    packages = _packages(root, jobs, "target")
    if len(packages) == 1 and packages[0].batched:
        from metrale.runtime.backends.aoti_batched import BatchedTarget

        # (the build's target package takes its rows' hidden drafts: `BatchedTreeTargetStep`)
        compiled = BatchedTarget(target, packages[0], taps, slots, hides=True)
        same = _check_batched(compiled, gen)
        ids = torch.randint(0, target.config.vocab_size, (1, 19), generator=gen)
        eager = target(ids, target.new_cache(1, 48)).logits
        worst = (compiled(ids, compiled.new_cache(1, 48)).logits - eager).abs().max().item()
        return {"rows_bit_identical": same, "max_abs_diff_vs_eager": worst,
                "tree_rows_bit_identical": _check_tree(compiled, gen)}
    whole = CompiledTarget(target, packages, taps, slots)
    one = CompiledTarget(target, [p for p in packages if p.rows == 1 or p.dynamic], taps, slots)
    ids = torch.randint(0, target.config.vocab_size, (1, 11 + whole.max_rows), generator=gen)
    same = True
    counts = range(2, whole.max_rows + 1) if any(p.dynamic for p in packages) else {p.rows for p in packages} - {1}
    for rows in sorted(counts):
        a, b = whole.new_cache(1, 48), one.new_cache(1, 48)
        whole(ids[:, :11], a)
        one(ids[:, :11], b)
        wide = whole(ids[:, 11:11 + rows], a, taps=taps)
        singles = [one(ids[:, i:i + 1], b, taps=taps) for i in range(11, 11 + rows)]
        for field in ("logits", "last_hidden", "taps"):
            if getattr(wide, field) is not None:
                same = same and torch.equal(getattr(wide, field), torch.cat([getattr(r, field) for r in singles], 1))
    eager = target(ids, target.new_cache(1, 48)).logits
    worst = (whole(ids, whole.new_cache(1, 48)).logits - eager).abs().max().item()
    return {"rows_bit_identical": same, "max_abs_diff_vs_eager": worst}


def _check_mtp(root, jobs, name, staged, slots, gen) -> dict:
    """Three sequences' entries, chunked differently and run together (two in one pool, one in
    another), against the eager head's for each sequence alone."""
    from metrale.runtime.steps import HeadForward
    from metrale.runtime.backends.aoti_batched import BatchedMTP

    head = staged.mtp
    (package,) = _packages(root, jobs, name)
    compiled = BatchedMTP(head, package, slots)
    h = head.config.decoder.hidden_size
    embeds, hidden = torch.randn(3, 1, 16, h, generator=gen), torch.randn(3, 1, 16, h, generator=gen)
    dtype = embeds.dtype
    mine = [compiled.new_cache(1, n, dtype) for n in (48, 48, 100)]
    eager = [head.new_cache(1, 48, dtype) for _ in range(3)]
    splits = [((0, 9), (9, 10), (10, 13), (13, 16)), ((0, 1), (1, 16)), ((0, 12), (12, 14), (14, 16))]
    worst = 0.0
    for step in range(max(len(s) for s in splits)):
        who = [b for b in range(3) if step < len(splits[b])]
        needs = [HeadForward(compiled, embeds[b][:, slice(*splits[b][step])],
                             hidden[b][:, slice(*splits[b][step])], mine[b], splits[b][step][0]) for b in who]
        for b, got in zip(who, compiled.forward_many(needs)):
            lo, hi = splits[b][step]
            want = head(embeds[b][:, lo:hi], hidden[b][:, lo:hi], eager[b], start=lo)
            worst = max(worst, (got[0] - want[0]).abs().max().item(), (got[1] - want[1]).abs().max().item())
    return {"max_abs_diff_vs_eager": worst}


def _check_drafter(root, jobs, name, staged, taps, slots, gen, fed_rows: int) -> dict:
    """Five sequences' proposes run together (feeds of different sizes, backlogs longer than a
    feed, which the package feeds whole as it is recorded to) against the eager drafter's for
    each sequence alone (`drafts_equal`, the share of equal draft tokens) and against the same
    package run one sequence at a time, feeding at most `feed` rows itself and the older ones
    of a longer backlog through the eager context projection (`batched_equal_alone`); `fed_rows`,
    the most context rows a call of the package feeds, as the manifest records it. Where the
    drafter has a tree's package besides (DFlash2's, with its selector's tables), every other
    call together runs it, asking for 16-node trees: its drafts count as the chain package's,
    and its tables must build the trees the host builds from the same call's logits and hidden
    states (`tables_trees_equal`, the share of equal trees)."""
    from metrale.runtime.spec.ddtree import SelectorChildren, block_tree, build_tree
    from metrale.runtime.steps import DraftForward
    from metrale.runtime.backends.aoti_dflash import BatchedDFlash

    drafter, target = staged.drafters[name], staged.target
    built = list(zip([j for j in jobs if j.name == name], _packages(root, jobs, name)))
    job, package = next((j, p) for j, p in built if not j.tables)
    together = BatchedDFlash(drafter, package, job.rows, slots)
    together.fed_rows, together.distributions = fed_rows, True  # as the build compiles it
    together.tree_package = next((p for j, p in built if j.tables), None)
    trees_equal = trees = 0
    alone = BatchedDFlash(drafter, package, job.rows, slots)
    cfg = drafter.config
    ids = torch.randint(0, target.config.vocab_size, (5, 30), generator=gen)
    taps = [target(ids[b:b + 1], target.new_cache(1, 40), taps=cfg.target_layer_ids).taps for b in range(5)]
    dtype, embed = taps[0].dtype, target.model.embed_tokens
    # each sequence's context so far after each propose: feeds of 11 (longer than a package's
    # feed: alone, its older rows go through the eager projection), 1, 3, 8, 1 and 6 rows, and
    # others
    schedule = [(11, 12, 15, 23, 24, 30), (1, 9, 10, 18, 26, 30), (20, 21, 22, 23, 29, 30),
                (2, 3, 4, 5, 6, 7), (8, 16, 24, 25, 27, 30)]
    eq_eager = eq_alone = total = 0
    for gamma in (cfg.block_size, min(4, cfg.block_size)):
        caches = [(together.new_cache(1, 48, dtype), alone.new_cache(1, 48, dtype),
                   drafter.new_cache(1, 48, dtype)) for _ in range(len(schedule))]
        done = [0] * len(schedule)
        for step in range(len(schedule[0])):
            needs = []
            for b, (mine, solo, eager) in enumerate(caches):
                upto = schedule[b][step]
                rows = taps[b][:, done[b]:upto]
                for face, cache in ((together, mine), (alone, solo), (drafter, eager)):
                    face.add_context(rows, cache)
                nodes = 16 if together.tree_package is not None and step % 2 == 0 else 0
                needs.append(DraftForward(together, ids[b, upto - 1:upto], embed, mine, gamma, nodes))
                done[b] = upto
            for (_, solo, eager), need, got in zip(caches, needs, together.forward_many(needs)):
                if need.tree_nodes:
                    anchor = int(need.anchor[0])
                    host = SelectorChildren(drafter.candidate_selector, got.hidden[0], got.logits[0], anchor)
                    tree = block_tree(drafter, anchor, got, need.tree_nodes)
                    want = build_tree(anchor, host, need.tree_nodes)
                    trees_equal += (tree.tokens, tree.parents) == (want.tokens, want.parents)
                    trees += 1
                one = alone.propose(need.anchor, embed, solo, gamma).tokens
                want = drafter.propose(need.anchor, embed, eager, gamma).tokens
                eq_eager += int((got.tokens == want).sum())
                eq_alone += int((got.tokens == one).sum())
                total += want.numel()
    return {"drafts_equal": round(eq_eager / total, 4), "batched_equal_alone": round(eq_alone / total, 4),
            **({"tables_trees_equal": round(trees_equal / trees, 4)} if trees else {})}


def load_packed(root: Path, kinds: dict, dtype: torch.dtype):
    """The staged models of a build (`trt_build.load_staged`), packed for inference as the
    decode loop runs them: what the CPU packages are compiled from and checked against."""
    from metrale.builder.trt_build import load_staged
    from metrale.runtime.models.layers import pack_for_inference

    staged = load_staged(root, kinds, dtype=dtype)
    for model in (staged.target, staged.mtp, *staged.drafters.values()):
        if model is not None:
            pack_for_inference(model).eval()
    return staged


def check_packages(root, jobs, kinds: dict, taps, slots: int, dtype, fed_rows: int) -> dict[str, dict]:
    """`kinds`: name -> manifest entry of the target and every component with packages;
    `fed_rows`: the most context rows a drafter package's call feeds."""
    staged = load_packed(root, kinds, dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        out = {"target": _check_target(root, jobs, staged, taps, slots, gen)}
        for name, info in kinds.items():
            if name == "target":
                continue
            if kind_named(info.kind).role is Role.HEAD:
                out[name] = _check_mtp(root, jobs, name, staged, slots, gen)
            else:
                out[name] = _check_drafter(root, jobs, name, staged, taps, slots, gen, fed_rows)
    return out
