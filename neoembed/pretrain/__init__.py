"""NeoBERT pre-training: token shards, MLM masking, padding-free packing, the two-stage schedule, a small
documented training loop (accelerate), and pseudo-perplexity.

    neoembed preprocess docs/ shards/ --tokenizer chandar-lab/NeoBERT --min-lengths 1024,2048
    neoembed pretrain pretrain-tiny tokenizer=chandar-lab/NeoBERT data.sources='[{path: shards/}]'
    neoembed ppl --model runs/pretrain-tiny --data shards/ --lengths 128,256,512
"""
