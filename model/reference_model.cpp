#include "reference_model.h"

#include <algorithm>
#include <cmath>

namespace deltatrain::model::reference {
namespace {

using Vec = std::vector<double>;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double silu(double x) { return x * sigmoid(x); }
double softplus(double x) { return std::log1p(std::exp(x)); }

// y = W x for W [out, in] row-major.
Vec matvec(const Vec& w, const Vec& x) {
  const std::size_t in = x.size(), out = w.size() / in;
  Vec y(out, 0.0);
  for (std::size_t o = 0; o < out; ++o) {
    for (std::size_t i = 0; i < in; ++i) y[o] += w[o * in + i] * x[i];
  }
  return y;
}

// Qwen's RMSNorm over x[begin, begin + n): x * rsqrt(mean(x^2) + eps) * (1 + w).
Vec rmsnorm(const Vec& x, std::size_t begin, std::size_t n, const Vec& w, double eps) {
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum += x[begin + i] * x[begin + i];
  const double rstd = 1.0 / std::sqrt(sum / double(n) + eps);
  Vec y(n);
  for (std::size_t i = 0; i < n; ++i) y[i] = x[begin + i] * rstd * (1.0 + w[i]);
  return y;
}

Vec l2normalize(const Vec& x, std::size_t begin, std::size_t n) {
  double sum = 0;
  for (std::size_t i = 0; i < n; ++i) sum += x[begin + i] * x[begin + i];
  Vec y(n);
  for (std::size_t i = 0; i < n; ++i) y[i] = x[begin + i] / std::sqrt(sum + 1e-6);
  return y;
}

// NeoX rotate_half on the first `rotary` elements of one head vector.
void rotate(Vec& x, int rotary, double position, double theta) {
  const int half = rotary / 2;
  for (int i = 0; i < half; ++i) {
    const double angle = position / std::pow(theta, 2.0 * i / rotary);
    const double a = x[i], b = x[i + half];
    x[i] = a * std::cos(angle) - b * std::sin(angle);
    x[i + half] = b * std::cos(angle) + a * std::sin(angle);
  }
}

struct Sequence {
  std::int32_t begin, end;
};

// One GDN layer over one sequence: rows of the normed input h [len][hidden] -> mixer output rows.
std::vector<Vec> gdn_layer(const Config& c, const ParamValues& p, const std::string& a, const std::vector<Vec>& h) {
  const int H = c.linear_num_key_heads, HV = c.linear_num_value_heads, dk = c.linear_key_head_dim,
            dv = c.linear_value_head_dim, W = c.linear_conv_kernel_dim;
  const std::size_t C = static_cast<std::size_t>(c.linear_conv_dim()), len = h.size();
  std::vector<Vec> qkv(len), z(len), beta(len), g(len);
  for (std::size_t t = 0; t < len; ++t) {
    qkv[t] = matvec(p(a + "in_proj_qkv.weight"), h[t]);
    z[t] = matvec(p(a + "in_proj_z.weight"), h[t]);
    const Vec b = matvec(p(a + "in_proj_b.weight"), h[t]), araw = matvec(p(a + "in_proj_a.weight"), h[t]);
    beta[t].resize(HV);
    g[t].resize(HV);
    for (int j = 0; j < HV; ++j) {
      beta[t][j] = sigmoid(b[j]);
      g[t][j] = -std::exp(p(a + "A_log")[j]) * softplus(araw[j] + p(a + "dt_bias")[j]);
    }
  }
  // Causal depthwise convolution that starts from zeros at the sequence start, then SiLU.
  const Vec& conv_w = p(a + "conv1d.weight");  // [C, 1, W]
  std::vector<Vec> mixed(len, Vec(C));
  for (std::size_t t = 0; t < len; ++t) {
    for (std::size_t ch = 0; ch < C; ++ch) {
      double sum = 0;
      for (int j = 0; j < W; ++j) {
        const long source = long(t) - (W - 1) + j;
        if (source >= 0) sum += conv_w[ch * W + j] * qkv[source][ch];
      }
      mixed[t][ch] = silu(sum);
    }
  }
  // The gated delta rule by its recurrence, one state per value head.
  const std::size_t key_dim = std::size_t(H) * dk;
  std::vector<Vec> core(len, Vec(std::size_t(HV) * dv));
  for (int j = 0; j < HV; ++j) {
    const int head = j / (HV / H);
    Vec state(std::size_t(dk) * dv, 0.0);  // [dk][dv]
    for (std::size_t t = 0; t < len; ++t) {
      const Vec q = l2normalize(mixed[t], std::size_t(head) * dk, dk);
      const Vec k = l2normalize(mixed[t], key_dim + std::size_t(head) * dk, dk);
      const double decay = std::exp(g[t][j]), scale = 1.0 / std::sqrt(double(dk));
      for (double& s : state) s *= decay;
      for (int e = 0; e < dv; ++e) {
        double kv = 0;
        for (int i = 0; i < dk; ++i) kv += state[i * dv + e] * k[i];
        const double v = mixed[t][2 * key_dim + std::size_t(j) * dv + e];
        const double delta = beta[t][j] * (v - kv);
        for (int i = 0; i < dk; ++i) state[i * dv + e] += k[i] * delta;
      }
      for (int e = 0; e < dv; ++e) {
        double o = 0;
        for (int i = 0; i < dk; ++i) o += state[i * dv + e] * q[i] * scale;
        core[t][std::size_t(j) * dv + e] = o;
      }
    }
  }
  // Gated RMSNorm per value head (weight w, not 1 + w), then out_proj.
  const Vec& norm_w = p(a + "norm.weight");
  std::vector<Vec> out(len);
  for (std::size_t t = 0; t < len; ++t) {
    Vec gated(std::size_t(HV) * dv);
    for (int j = 0; j < HV; ++j) {
      double sum = 0;
      for (int e = 0; e < dv; ++e) sum += core[t][j * dv + e] * core[t][j * dv + e];
      const double rstd = 1.0 / std::sqrt(sum / dv + c.rms_norm_eps);
      for (int e = 0; e < dv; ++e) {
        gated[j * dv + e] = norm_w[e] * core[t][j * dv + e] * rstd * silu(z[t][j * dv + e]);
      }
    }
    out[t] = matvec(p(a + "out_proj.weight"), gated);
  }
  return out;
}

std::vector<Vec> attention_layer(const Config& c, const ParamValues& p, const std::string& a,
                                 const std::vector<Vec>& h) {
  const int Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, hd = c.head_dim;
  const std::size_t len = h.size();
  std::vector<Vec> q(len), gate(len), k(len), v(len);
  for (std::size_t t = 0; t < len; ++t) {
    const Vec qg = matvec(p(a + "q_proj.weight"), h[t]);  // per head [query | gate]
    const Vec kr = matvec(p(a + "k_proj.weight"), h[t]);
    v[t] = matvec(p(a + "v_proj.weight"), h[t]);
    for (int head = 0; head < Hq; ++head) {
      Vec qh = rmsnorm(qg, std::size_t(head) * 2 * hd, hd, p(a + "q_norm.weight"), c.rms_norm_eps);
      rotate(qh, c.rotary_dim(), double(t), c.rope_theta);
      q[t].insert(q[t].end(), qh.begin(), qh.end());
      gate[t].insert(gate[t].end(), qg.begin() + std::ptrdiff_t(head) * 2 * hd + hd,
                     qg.begin() + std::ptrdiff_t(head) * 2 * hd + 2 * hd);
    }
    for (int head = 0; head < Hkv; ++head) {
      Vec kh = rmsnorm(kr, std::size_t(head) * hd, hd, p(a + "k_norm.weight"), c.rms_norm_eps);
      rotate(kh, c.rotary_dim(), double(t), c.rope_theta);
      k[t].insert(k[t].end(), kh.begin(), kh.end());
    }
  }
  std::vector<Vec> out(len);
  const double scale = 1.0 / std::sqrt(double(hd));
  for (std::size_t t = 0; t < len; ++t) {
    Vec gated(std::size_t(Hq) * hd, 0.0);
    for (int head = 0; head < Hq; ++head) {
      const int kv = head / (Hq / Hkv);
      Vec scores(t + 1);
      for (std::size_t s = 0; s <= t; ++s) {
        double dot = 0;
        for (int i = 0; i < hd; ++i) dot += q[t][head * hd + i] * k[s][kv * hd + i];
        scores[s] = dot * scale;
      }
      const double max = *std::max_element(scores.begin(), scores.end());
      double sum = 0;
      for (double& x : scores) sum += (x = std::exp(x - max));
      for (int i = 0; i < hd; ++i) {
        double o = 0;
        for (std::size_t s = 0; s <= t; ++s) o += scores[s] / sum * v[s][kv * hd + i];
        gated[head * hd + i] = o * sigmoid(gate[t][head * hd + i]);
      }
    }
    out[t] = matvec(p(a + "o_proj.weight"), gated);
  }
  return out;
}

}  // namespace

ReferenceOutput reference_forward(const Config& c, const ParamValues& p, const std::vector<std::int32_t>& tokens,
                                  const std::vector<std::int32_t>& cu_seqlens,
                                  const std::vector<std::int32_t>& targets, const std::vector<double>& weights) {
  const std::size_t hidden = static_cast<std::size_t>(c.hidden_size), V = static_cast<std::size_t>(c.vocab_size);
  const Vec& embedding = p("model.embed_tokens.weight");
  const Vec& lm_head = c.tie_word_embeddings ? embedding : p("lm_head.weight");
  ReferenceOutput out;
  out.logits.resize(tokens.size() * V);
  out.logprobs.assign(tokens.size(), 0.0);
  for (std::size_t n = 0; n + 1 < cu_seqlens.size(); ++n) {
    const Sequence seq{cu_seqlens[n], cu_seqlens[n + 1]};
    std::vector<Vec> x;
    for (std::int32_t t = seq.begin; t < seq.end; ++t) {
      x.emplace_back(embedding.begin() + std::ptrdiff_t(tokens[t]) * hidden,
                     embedding.begin() + std::ptrdiff_t(tokens[t] + 1) * hidden);
    }
    for (int l = 0; l < c.num_hidden_layers(); ++l) {
      const std::string prefix = "model.layers." + std::to_string(l) + ".";
      std::vector<Vec> h;
      for (const Vec& row : x) h.push_back(rmsnorm(row, 0, hidden, p(prefix + "input_layernorm.weight"), c.rms_norm_eps));
      const std::vector<Vec> mixed = c.layer_types[l] == LayerKind::linear_attention
                                         ? gdn_layer(c, p, prefix + "linear_attn.", h)
                                         : attention_layer(c, p, prefix + "self_attn.", h);
      for (std::size_t t = 0; t < x.size(); ++t) {
        for (std::size_t i = 0; i < hidden; ++i) x[t][i] += mixed[t][i];
        const Vec hn = rmsnorm(x[t], 0, hidden, p(prefix + "post_attention_layernorm.weight"), c.rms_norm_eps);
        const Vec gate = matvec(p(prefix + "mlp.gate_proj.weight"), hn);
        const Vec up = matvec(p(prefix + "mlp.up_proj.weight"), hn);
        Vec act(gate.size());
        for (std::size_t i = 0; i < act.size(); ++i) act[i] = silu(gate[i]) * up[i];
        const Vec down = matvec(p(prefix + "mlp.down_proj.weight"), act);
        for (std::size_t i = 0; i < hidden; ++i) x[t][i] += down[i];
      }
    }
    for (std::size_t t = 0; t < x.size(); ++t) {
      const std::size_t token = std::size_t(seq.begin) + t;
      const Vec hn = rmsnorm(x[t], 0, hidden, p("model.norm.weight"), c.rms_norm_eps);
      const Vec logits = matvec(lm_head, hn);
      std::copy(logits.begin(), logits.end(), out.logits.begin() + std::ptrdiff_t(token * V));
      if (targets[token] < 0) continue;
      const double max = *std::max_element(logits.begin(), logits.end());
      double sum = 0;
      for (double l : logits) sum += std::exp(l - max);
      out.logprobs[token] = logits[targets[token]] - max - std::log(sum);
      out.loss -= weights[token] * out.logprobs[token];
    }
  }
  return out;
}

}  // namespace deltatrain::model::reference
