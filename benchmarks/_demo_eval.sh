# Sourced by the demonstration scripts: build an `neoembed mteb --data-dir` folder from ../shared/data.
#   demo_eval_dir DIR SHARED TASK...   TASK is an MTEB folder of SHARED/data/mteb (STS13, SICK-R, ...), or MSRP /
#                                      TrecQA, which get a task card on SHARED/data/eval/<name>
demo_eval_dir() {
  local dir=$1 shared=$2
  shift 2
  mkdir -p "$dir"
  for t in "$@"; do
    case $t in
      MSRP)
        mkdir -p "$dir/MSRP"
        printf '%s\n' "name: MSRP" "type: PairClassification" "data: $shared/data/eval/MSRP" \
          "columns: {labels: label}" \
          "instruction: Retrieve text that are semantically similar to the given text." > "$dir/MSRP/task.yaml" ;;
      TrecQA)
        mkdir -p "$dir/TrecQA"
        printf '%s\n' "name: TrecQA" "type: Reranking" "data: $shared/data/eval/TrecQA" \
          "instruction: Given a question, retrieve sentences that answer the question." > "$dir/TrecQA/task.yaml" ;;
      *) ln -sfn "$shared/data/mteb/$t" "$dir/$t" ;;
    esac
  done
}
