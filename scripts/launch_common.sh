# Sourced by launch_tpu_pod.sh and launch_slurm.sh: errors, quoting and the command line they share.
#
# A launcher defines prog, usage(), valued_flags and switch_flags (space-padded lists: " --a --b "), set_opt FLAG
# VALUE and set_switch FLAG, then calls parse_args "$@": the train.py overrides after -- land in the array overrides.

die() {
  printf '%s: error: %s\n' "$prog" "$*" >&2
  exit 2
}

# Words quoted for bash (printf %q) and joined by spaces: the line reads back as exactly these words, whatever
# spaces, brackets or quotes an override holds.
join_q() {
  local out="" w
  for w in "$@"; do out+="${out:+ }$(printf '%q' "$w")"; done
  printf '%s' "$out"
}

_in_list() {  # word list
  [[ $2 == *[[:space:]]"$1"[[:space:]]* ]]
}

# Whether a word is one of the launcher's flags (with or without =value): a flag where a value belongs means the value
# was forgotten. Other words starting with -- are values (--sbatch-arg --qos=high).
is_flag() {
  local name=${1%%=*}
  _in_list "$name" "$valued_flags" || _in_list "$name" "$switch_flags" || [[ $name == -h || $name == -- ]]
}

parse_args() {
  overrides=()
  local arg
  while (($#)); do
    arg=$1
    shift
    case $arg in
      --) overrides=("$@"); break ;;
      -h | --help) usage; exit 0 ;;
      --*=*)
        ! _in_list "${arg%%=*}" "$switch_flags" || die "${arg%%=*} takes no value"
        _in_list "${arg%%=*}" "$valued_flags" || die "unknown flag ${arg%%=*} (see --help)"
        set_opt "${arg%%=*}" "${arg#*=}"
        ;;
      --*)
        if _in_list "$arg" "$switch_flags"; then
          set_switch "$arg"
          continue
        fi
        _in_list "$arg" "$valued_flags" || die "unknown flag $arg (see --help)"
        (($#)) && ! is_flag "$1" || die "$arg needs a value (see --help)"
        set_opt "$arg" "$1"
        shift
        ;;
      *) die "unexpected argument '$arg': train.py overrides go after -- (see --help)" ;;
    esac
  done
  for arg in ${overrides[@]+"${overrides[@]}"}; do
    [[ $arg =~ ^[A-Za-z_][A-Za-z0-9_.]*= ]] || die "override '$arg' after -- is not key=value (e.g. train.steps=500)"
  done
}

# The run name a config file gives: its file name without .yaml.
config_run_name() {
  local name=${1##*/}
  name=${name%.yaml}
  printf '%s' "${name%.yml}"
}
