// llama.cpp's C API, teacher-forced, one token per llama_decode: the llama.cpp side of
// bench/llama_cpp_peer.py (issue 45) and of the larger-than-RAM benchmark (issue 46).
//
// Built by bench/llama_cpp_prebuilt.py with the machine's g++ against the headers of the
// llama.cpp release that npm's node-llama-cpp ships and the prebuilt libllama / libggml of
// @node-llama-cpp/linux-x64 (rpath to them). It owns one process's measurement of llama.cpp;
// it does not convert checkpoints (the release's convert_hf_to_gguf.py does) nor compare
// sides (the Python bench does).
//
// Subcommands (every one: --backend-dir DIR, the folder of libggml-cpu-*.so: ggml scores each
// variant against this CPU and loads the best; JSON on stdout, llama.cpp's log on stderr):
//   info                                   the release, the CPU backend loaded, its features, and
//                                          the score of every variant on this CPU
//   quantize IN.gguf OUT.gguf TYPE         llama_model_quantize (TYPE: Q4_0, Q8_0, BF16, F16)
//                                          with llama-quantize's defaults (output tensor Q6_K
//                                          for Q4_0 where its rows allow)
//   tokenize MODEL.gguf TEXT_FILE          the GGUF vocabulary's ids of the text (no BOS)
//   run MODEL.gguf IDS_FILE --prefill P --decode N [--threads T] [--load-mode auto|none|mmap]
//       [--no-repack] [--logits OUT.f32]
//                                          IDS_FILE: P + N token ids (whitespace separated).
//                                          An untimed prefill of ids[0, P) in one llama_decode,
//                                          then N decode steps, step i feeding ids[P + i] alone;
//                                          per step: process CPU s (getrusage RUSAGE_SELF,
//                                          user + sys: every ggml thread), this thread's CPU s,
//                                          wall s, the argmax of the step's logits; bytes read
//                                          from storage (/proc/self/io read_bytes) during load,
//                                          prefill and decode; peak RSS (VmHWM). --no-repack is
//                                          llama.cpp's --no-repack (model params
//                                          use_extra_bufts = false); --load-mode is its
//                                          --load-mode (auto: mmap). --logits writes the N
//                                          steps' logits, float32 [N, vocab], row-major.

#include "ggml-backend.h"
#include "llama.h"

#include <dlfcn.h>
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Options {
    std::string backend_dir;
    int prefill = -1;
    int decode = -1;
    int threads = 1;
    std::string load_mode = "auto";
    bool no_repack = false;
    std::string logits_path;
    bool verbose = false;
    std::vector<std::string> positional;
};

struct Step {
    double cpu_s, thread_cpu_s, wall_s;
    int argmax;
};

[[noreturn]] void die(const std::string & msg) {
    std::fprintf(stderr, "llama_cpp_driver: %s\n", msg.c_str());
    std::exit(2);
}

// llama.cpp's log lines: to stderr (errors always, the rest with --verbose); the buffer-size lines
// are kept, they say where the weights went (CPU_Mapped, CPU, CPU_REPACK, AMX).
std::vector<std::string> g_buffer_lines;  // only written by the log callback, on the loading thread
bool g_verbose = false;

void on_log(ggml_log_level level, const char * text, void *) {
    if (std::strstr(text, "buffer size") != nullptr) {
        std::string line(text);
        line.erase(std::remove(line.begin(), line.end(), '\n'), line.end());
        g_buffer_lines.push_back(line);
    }
    if (g_verbose || level == GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

double clock_s(clockid_t id) {
    timespec ts{};
    clock_gettime(id, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

double process_cpu_s() {
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
}

long long io_read_bytes() {
    std::ifstream f("/proc/self/io");
    std::string key;
    long long value = 0;
    while (f >> key >> value) {
        if (key == "read_bytes:") {
            return value;
        }
    }
    return -1;
}

// VmHWM of /proc/self/status: this process image's peak RSS (getrusage's ru_maxrss would carry the
// peak of the process that forked this one across the exec).
long peak_rss_kb() {
    std::ifstream f("/proc/self/status");
    std::string key;
    while (f >> key) {
        long kb = 0;
        if (key == "VmHWM:" && f >> kb) {
            return kb;
        }
    }
    return -1;
}

std::string json_str(const std::string & s) {
    std::string out = "\"";
    for (char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", c);
            out += buf;
        } else {
            out += c;
        }
    }
    return out + "\"";
}

// The libggml-cpu-*.so this process mapped (/proc/self/maps): the variant ggml chose.
std::string mapped_cpu_backend() {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line)) {
        auto pos = line.find('/');
        if (pos != std::string::npos && line.find("libggml-cpu") != std::string::npos) {
            return line.substr(pos);
        }
    }
    return "";
}

// Every libggml-cpu-*.so of the folder with the score ggml gives it on this CPU (0: not runnable
// here; ggml loads the highest).
std::string variant_scores(const std::string & dir) {
    std::vector<std::pair<std::string, int>> scores;
    for (const auto & entry : std::filesystem::directory_iterator(dir)) {
        const std::string name = entry.path().filename().string();
        if (name.rfind("libggml-cpu-", 0) != 0) {
            continue;
        }
        void * handle = dlopen(entry.path().c_str(), RTLD_NOW | RTLD_LOCAL);
        auto score = handle ? (int (*)()) dlsym(handle, "ggml_backend_score") : nullptr;
        scores.emplace_back(name, score ? score() : -1);
        if (handle) {
            dlclose(handle);
        }
    }
    std::sort(scores.begin(), scores.end());
    std::string out;
    for (const auto & [name, score] : scores) {
        out += (out.empty() ? "" : ", ") + json_str(name) + ": " + std::to_string(score);
    }
    return "{" + out + "}";
}

std::string backend_json() {
    ggml_backend_reg_t cpu = ggml_backend_reg_by_name("CPU");
    if (cpu == nullptr) {
        die("no CPU backend loaded: is --backend-dir the folder of libggml-cpu-*.so?");
    }
    std::string features;
    auto get_features = (ggml_backend_get_features_t) ggml_backend_reg_get_proc_address(cpu, "ggml_backend_get_features");
    for (auto * f = get_features ? get_features(cpu) : nullptr; f && f->name; ++f) {
        features += (features.empty() ? "" : ", ") + json_str(f->name) + ": " + json_str(f->value);
    }
    return "\"cpu_backend\": " + json_str(mapped_cpu_backend()) + ", \"cpu_features\": {" + features +
           "}, \"llama_version\": " + json_str(llama_version()) + ", \"system_info\": " +
           json_str(llama_print_system_info());
}

std::vector<llama_token> read_ids(const std::string & path) {
    std::ifstream f(path);
    if (!f) {
        die("cannot read the ids file " + path);
    }
    std::vector<llama_token> ids;
    long long id;
    while (f >> id) {
        ids.push_back(static_cast<llama_token>(id));
    }
    return ids;
}

int argmax(const float * logits, int n) {
    return static_cast<int>(std::max_element(logits, logits + n) - logits);
}

llama_model * load(const std::string & path, const Options & o) {
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    mp.load_mode = llama_load_mode_from_str(o.load_mode.c_str());
    mp.use_extra_bufts = !o.no_repack;
    llama_model * model = llama_model_load_from_file(path.c_str(), mp);
    if (model == nullptr) {
        die("llama_model_load_from_file failed on " + path + " (see the log above)");
    }
    return model;
}

int cmd_quantize(const Options & o) {
    if (o.positional.size() != 3) {
        die("quantize IN.gguf OUT.gguf TYPE");
    }
    const std::string & type = o.positional[2];
    llama_model_quantize_params qp = llama_model_quantize_default_params();
    qp.nthread = o.threads;
    if (type == "Q4_0") {
        qp.ftype = LLAMA_FTYPE_MOSTLY_Q4_0;
    } else if (type == "Q8_0") {
        qp.ftype = LLAMA_FTYPE_MOSTLY_Q8_0;
    } else if (type == "BF16") {
        qp.ftype = LLAMA_FTYPE_MOSTLY_BF16;
    } else if (type == "F16") {
        qp.ftype = LLAMA_FTYPE_MOSTLY_F16;
    } else {
        die("quantize: TYPE " + type + " is not one of Q4_0, Q8_0, BF16, F16");
    }
    double t0 = clock_s(CLOCK_MONOTONIC);
    if (llama_model_quantize(o.positional[0].c_str(), o.positional[1].c_str(), &qp) != 0) {
        die("llama_model_quantize failed: " + o.positional[0] + " -> " + o.positional[1]);
    }
    std::printf("{\"out\": %s, \"type\": %s, \"wall_s\": %.3f, %s}\n", json_str(o.positional[1]).c_str(),
                json_str(type).c_str(), clock_s(CLOCK_MONOTONIC) - t0, backend_json().c_str());
    return 0;
}

int cmd_tokenize(const Options & o) {
    if (o.positional.size() != 2) {
        die("tokenize MODEL.gguf TEXT_FILE");
    }
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(o.positional[0].c_str(), mp);
    if (model == nullptr) {
        die("cannot load the vocabulary of " + o.positional[0]);
    }
    std::ifstream f(o.positional[1]);
    std::stringstream text;
    text << f.rdbuf();
    const std::string s = text.str();
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::vector<llama_token> ids(s.size() + 16);
    int n = llama_tokenize(vocab, s.c_str(), static_cast<int32_t>(s.size()), ids.data(), static_cast<int32_t>(ids.size()),
                           /*add_special=*/false, /*parse_special=*/false);
    if (n < 0) {
        die("llama_tokenize: buffer too small");
    }
    std::printf("{\"n_vocab\": %d, \"ids\": [", llama_vocab_n_tokens(vocab));
    for (int i = 0; i < n; ++i) {
        std::printf("%s%d", i ? ", " : "", ids[i]);
    }
    std::printf("]}\n");
    llama_model_free(model);
    return 0;
}

int cmd_run(const Options & o) {
    if (o.positional.size() != 2 || o.prefill < 1 || o.decode < 1) {
        die("run MODEL.gguf IDS_FILE --prefill P --decode N (P, N >= 1)");
    }
    std::vector<llama_token> ids = read_ids(o.positional[1]);
    if (static_cast<int>(ids.size()) < o.prefill + o.decode) {
        die(o.positional[1] + " holds " + std::to_string(ids.size()) + " ids, fewer than --prefill " +
            std::to_string(o.prefill) + " + --decode " + std::to_string(o.decode));
    }
    const long long io0 = io_read_bytes();
    const double load_wall0 = clock_s(CLOCK_MONOTONIC);
    llama_model * model = load(o.positional[0], o);
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    for (int i = 0; i < o.prefill + o.decode; ++i) {
        if (ids[i] < 0 || ids[i] >= n_vocab) {
            die("token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) + " is outside the vocabulary [0, " +
                std::to_string(n_vocab) + ")");
        }
    }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = o.prefill + o.decode;
    cp.n_batch = std::max<uint32_t>(cp.n_batch, o.prefill);
    cp.n_threads = o.threads;
    cp.n_threads_batch = o.threads;
    cp.no_perf = true;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (ctx == nullptr) {
        die("llama_init_from_model failed");
    }
    const double load_wall = clock_s(CLOCK_MONOTONIC) - load_wall0;
    const long long io_loaded = io_read_bytes();
    const long rss_loaded = peak_rss_kb();

    const double prefill_wall0 = clock_s(CLOCK_MONOTONIC), prefill_cpu0 = process_cpu_s();
    if (llama_decode(ctx, llama_batch_get_one(ids.data(), o.prefill)) != 0) {
        die("llama_decode failed on the prefill");
    }
    const double prefill_wall = clock_s(CLOCK_MONOTONIC) - prefill_wall0, prefill_cpu = process_cpu_s() - prefill_cpu0;
    const long long io_prefilled = io_read_bytes();

    std::FILE * logits_out = o.logits_path.empty() ? nullptr : std::fopen(o.logits_path.c_str(), "wb");
    if (!o.logits_path.empty() && logits_out == nullptr) {
        die("cannot write " + o.logits_path);
    }
    std::vector<Step> steps;
    steps.reserve(o.decode);
    for (int i = 0; i < o.decode; ++i) {
        llama_token token = ids[o.prefill + i];
        const double w0 = clock_s(CLOCK_MONOTONIC), t0 = clock_s(CLOCK_THREAD_CPUTIME_ID), c0 = process_cpu_s();
        if (llama_decode(ctx, llama_batch_get_one(&token, 1)) != 0) {
            die("llama_decode failed at decode step " + std::to_string(i));
        }
        const float * logits = llama_get_logits_ith(ctx, -1);
        const double c1 = process_cpu_s(), t1 = clock_s(CLOCK_THREAD_CPUTIME_ID), w1 = clock_s(CLOCK_MONOTONIC);
        steps.push_back({c1 - c0, t1 - t0, w1 - w0, argmax(logits, n_vocab)});
        if (logits_out != nullptr) {
            std::fwrite(logits, sizeof(float), n_vocab, logits_out);
        }
    }
    if (logits_out != nullptr) {
        std::fclose(logits_out);
    }
    const long long io_decoded = io_read_bytes();

    std::string cpu, thread_cpu, wall, top;
    for (size_t i = 0; i < steps.size(); ++i) {
        const char * sep = i ? ", " : "";
        cpu += sep + std::to_string(steps[i].cpu_s);
        thread_cpu += sep + std::to_string(steps[i].thread_cpu_s);
        wall += sep + std::to_string(steps[i].wall_s);
        top += sep + std::to_string(steps[i].argmax);
    }
    std::string buffers;
    for (const auto & line : g_buffer_lines) {
        buffers += (buffers.empty() ? "" : ", ") + json_str(line);
    }
    std::printf("{\"model\": %s, \"prefill\": %d, \"decode\": %d, \"threads\": %d, \"load_mode\": %s, \"repack\": %s, "
                "\"n_vocab\": %d, \"cpu_s\": [%s], \"thread_cpu_s\": [%s], \"wall_s\": [%s], \"argmax\": [%s], "
                "\"load_wall_s\": %.4f, \"prefill_wall_s\": %.4f, \"prefill_cpu_s\": %.4f, \"load_read_bytes\": %lld, "
                "\"prefill_read_bytes\": %lld, \"decode_read_bytes\": %lld, \"rss_after_load_kb\": %ld, "
                "\"peak_rss_kb\": %ld, \"buffers\": [%s], %s}\n",
                json_str(o.positional[0]).c_str(), o.prefill, o.decode, o.threads, json_str(o.load_mode).c_str(),
                o.no_repack ? "false" : "true", n_vocab, cpu.c_str(), thread_cpu.c_str(), wall.c_str(), top.c_str(), load_wall,
                prefill_wall, prefill_cpu, io_loaded - io0, io_prefilled - io_loaded, io_decoded - io_prefilled, rss_loaded,
                peak_rss_kb(), buffers.c_str(), backend_json().c_str());
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}

Options parse(int argc, char ** argv) {
    Options o;
    auto value = [&](int & i) -> std::string {
        if (i + 1 >= argc) {
            die(std::string(argv[i]) + " needs a value");
        }
        return argv[++i];
    };
    for (int i = 2; i < argc; ++i) {
        std::string a = argv[i];
        if (a == "--backend-dir") {
            o.backend_dir = value(i);
        } else if (a == "--prefill") {
            o.prefill = std::atoi(value(i).c_str());
        } else if (a == "--decode") {
            o.decode = std::atoi(value(i).c_str());
        } else if (a == "--threads") {
            o.threads = std::atoi(value(i).c_str());
        } else if (a == "--load-mode") {
            o.load_mode = value(i);
        } else if (a == "--no-repack") {
            o.no_repack = true;
        } else if (a == "--logits") {
            o.logits_path = value(i);
        } else if (a == "--verbose") {
            o.verbose = true;
        } else if (a.rfind("--", 0) == 0) {
            die("unknown flag " + a);
        } else {
            o.positional.push_back(a);
        }
    }
    if (o.backend_dir.empty()) {
        die("--backend-dir DIR (the folder of libggml-cpu-*.so) is required");
    }
    if (o.threads < 1) {
        die("--threads " + std::to_string(o.threads) + ": need >= 1");
    }
    if (o.load_mode != "auto" && o.load_mode != "none" && o.load_mode != "mmap") {
        die("--load-mode " + o.load_mode + ": one of auto, none, mmap");
    }
    return o;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        die("usage: llama_cpp_driver info|quantize|tokenize|run ... --backend-dir DIR");
    }
    const std::string cmd = argv[1];
    Options o = parse(argc, argv);
    g_verbose = o.verbose;
    llama_log_set(on_log, nullptr);
    ggml_backend_load_all_from_path(o.backend_dir.c_str());
    llama_backend_init();
    if (cmd == "info") {
        std::printf("{%s, \"variant_scores\": %s}\n", backend_json().c_str(), variant_scores(o.backend_dir).c_str());
        return 0;
    }
    if (cmd == "quantize") {
        return cmd_quantize(o);
    }
    if (cmd == "tokenize") {
        return cmd_tokenize(o);
    }
    if (cmd == "run") {
        return cmd_run(o);
    }
    die("unknown subcommand " + cmd + " (info, quantize, tokenize, run)");
}
