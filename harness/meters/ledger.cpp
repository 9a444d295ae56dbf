// The memory meter's per-op accounting, in C++ (docs/memory.md, "The ledger").
//
// It counts what `memory.ModeLedger`, its reference, counts, from the same events: an op's outputs
// whose storages none of its inputs has are new; a storage dies when its last reference goes. It
// sees the ops through a thread-local RecordFunction callback, not a Python dispatch mode, so an op
// costs no Python frame. A RecordFunction fires at every dispatcher call, and a dispatch mode sees
// fewer: only an op that reaches the Python key, so not a CompositeImplicitAutograd op (its parts
// do), nothing a kernel calls inside itself, and nothing while the Python key is excluded (the
// `empty` inside `torch.tensor`). The ledger takes exactly those ops.
// Tensor and the pybind11 casters of torch's Python types: not <torch/extension.h>, whose C++ frontend
// (modules, optimisers, data loaders) the ledger never uses and which more than doubles its build time.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/record_function.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/DynamicTypes.h>

#include <algorithm>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

using Key = c10::StorageImpl*;
using StorageRef = c10::weak_intrusive_ptr<c10::StorageImpl>;

struct Entry {
  int64_t nbytes;
  std::vector<int64_t> shape;  // of the first tensor seen in it
  c10::ScalarType dtype;
  std::string op;  // the op that allocated it ("saved" when only the saved-tensor hook saw it)
  uint64_t seq;    // order of first sight: ties in size are listed in it, as a dict would
  StorageRef ref;
  bool saved = false;
  bool output = false;
};
using EntryPtr = std::shared_ptr<Entry>;
using Entries = std::vector<EntryPtr>;

struct OpInfo {
  bool op;              // a dispatcher op (a RecordFunction also names autograd Functions, user ranges)
  bool seen_by_a_mode;  // not CompositeImplicitAutograd: it reaches the Python key whole
  bool fresh_outputs;   // no return may alias an argument: every output storage is new
  bool collective;      // a c10d op: its work object holds its tensors past the call
  std::string name;     // "addmm", as `OpOverload.overloadpacket.__name__`
};

const OpInfo& op_info(const at::RecordFunction& fn) {
  // RecordFunction names a dispatcher op by its schema's string, which lives as long as the op.
  static std::unordered_map<const char*, OpInfo> cache;
  const char* key = fn.name();
  auto it = cache.find(key);
  if (it != cache.end()) {
    return it->second;
  }
  OpInfo info{false, false, false, false, ""};
  std::string full = key;
  info.collective = full.rfind("c10d::", 0) == 0;
  info.name = full.substr(full.rfind(':') == std::string::npos ? 0 : full.rfind(':') + 1);
  auto op = c10::Dispatcher::singleton().findSchema({full, fn.overload_name()});
  if (op) {
    info.op = true;
    info.seen_by_a_mode = !op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
    const auto& returns = op->schema().returns();
    info.fresh_outputs = std::none_of(returns.begin(), returns.end(),
                                      [](const c10::Argument& r) { return r.alias_info() != nullptr; });
  }
  return cache.emplace(key, std::move(info)).first->second;
}

template <class F>
void each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec()) f(t);
  } else if (v.isList()) {
    for (const c10::IValue& x : v.toListRef()) each_tensor(x, f);
  } else if (v.isTuple()) {
    for (const c10::IValue& x : v.toTupleRef().elements()) each_tensor(x, f);
  }
}

Key key_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  return t.storage().unsafeGetStorageImpl();
}

class Ledger;
thread_local Ledger* tl_ledger = nullptr;

struct Call : at::ObserverContext {
  const OpInfo* info;
  std::vector<Key> args;
};
// The op under way that a dispatch mode would have seen: what it calls inside, a mode never sees.
thread_local const Call* tl_call = nullptr;

class Ledger {
 public:
  explicit Ledger(const std::vector<int64_t>& inputs) {
    for (int64_t k : inputs) inputs_.insert(reinterpret_cast<Key>(k));
  }
  ~Ledger() { detach(); }

  void attach() {
    TORCH_CHECK(tl_ledger == nullptr, "a ledger is already attached on this thread");
    tl_ledger = this;
    tl_call = nullptr;
    handle_ = at::addThreadLocalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                             .needsInputs(true)
                                             .needsOutputs(true)
                                             .scopes({at::RecordScope::FUNCTION}));
  }

  void detach() {
    if (handle_ != 0) {
      at::removeCallback(handle_);
      handle_ = 0;
    }
    if (tl_ledger == this) tl_ledger = nullptr;
  }

  // ------------------------------------------------------------ accounting
  void drain() {
    for (auto it = live_.begin(); it != live_.end();) {
      if (it->second->ref.expired()) {
        current_ -= it->second->nbytes;
        it = live_.erase(it);
      } else {
        ++it;
      }
    }
  }

  void settle() {
    drain();
    for (auto it = aliases_.begin(); it != aliases_.end();) {
      int64_t held = 0;
      for (const auto& a : it->second) held += a.expired() ? 0 : 1;
      auto entry = live_.find(it->first);
      if (entry == live_.end() || held == 0) {
        it = aliases_.erase(it);
        continue;
      }
      const StorageRef& ref = entry->second->ref;
      int64_t own = ref._unsafe_get_target()->pyobj_slot()->load_pyobj() != nullptr ? 1 : 0;
      if (static_cast<int64_t>(ref.use_count()) <= held + own) {
        current_ -= entry->second->nbytes;
        live_.erase(entry);
        it = aliases_.erase(it);
      } else {
        ++it;
      }
    }
  }

  EntryPtr add(Key key, const at::Tensor& t, const std::string& op) {
    c10::Storage s = t.storage();
    auto e = std::make_shared<Entry>(Entry{static_cast<int64_t>(s.nbytes()), t.sizes().vec(), t.scalar_type(), op,
                                           seq_++, StorageRef(s.getWeakStorageImpl())});
    live_[key] = e;
    current_ += e->nbytes;
    note_peak();
    return e;
  }

  void note_peak() {
    if (current_ > peak_) {
      peak_ = current_;
      peak_live_ = values();
    }
  }

  void after_op(const Call& call, const std::vector<c10::IValue>& outputs) {
    if (!aliases_.empty()) {
      settle();
    } else {
      drain();
    }
    for (const c10::IValue& v : outputs) {
      each_tensor(v, [&](const at::Tensor& t) {
        Key key = key_of(t);
        if (key == nullptr || inputs_.count(key)) return;
        auto it = live_.find(key);
        if (it != live_.end()) {  // written through an alias or out=; it may have been resized
          int64_t grown = static_cast<int64_t>(key->nbytes()) - it->second->nbytes;
          if (grown) {
            it->second->nbytes += grown;
            current_ += grown;
            note_peak();
          }
          return;
        }
        bool new_storage = (call.info->fresh_outputs && !call.info->collective) ||
                           std::find(call.args.begin(), call.args.end(), key) == call.args.end();
        if (new_storage) {
          add(key, t, call.info->name);
        }
      });
    }
  }

  // Autograd saves an op's output before the op returns, so the ledger often meets a new storage
  // here first: it is accounted as at the end of an op, and named after the op under way.
  void pack(const at::Tensor& t) {
    if (!aliases_.empty()) {
      settle();
    } else {
      drain();
    }
    Key key = key_of(t);
    if (key == nullptr || inputs_.count(key)) return;
    auto it = live_.find(key);
    EntryPtr e = it != live_.end() ? it->second : add(key, t, tl_call != nullptr ? tl_call->info->name : "saved");
    e->saved = true;
  }

  // A collective's tensors, as handed to it: an alias (sharing storage and version counter) for
  // a counted storage, so that its work object's references can be told from everyone else's.
  at::Tensor alias(const at::Tensor& t) {
    Key key = key_of(t);
    if (key == nullptr || !live_.count(key)) return t;
    at::Tensor a = t.detach();
    aliases_[key].push_back(c10::weak_intrusive_ptr<c10::TensorImpl>(a.getIntrusivePtr()));
    return a;
  }

  // The first collective that was handed a counted storage other than through `alias` (a routine
  // calling a ProcessGroup directly): from then on a free can race with a backend thread.
  const std::string& unaliased() const { return unaliased_; }

  bool aliased(const at::Tensor& t) const {
    Key key = key_of(t);
    if (key == nullptr || !live_.count(key)) return true;  // not counted: nothing to race
    auto it = aliases_.find(key);
    if (it == aliases_.end()) return false;
    for (const auto& a : it->second) {
      if (!a.expired() && a._unsafe_get_target() == t.unsafeGetTensorImpl()) return true;
    }
    return false;
  }

  // ------------------------------------------------------------ phases
  py::dict forward_end() {
    settle();
    retained_ = live_;
    int64_t saved = 0;
    for (const auto& kv : live_) saved += kv.second->saved ? kv.second->nbytes : 0;
    py::dict f;
    f["retained"] = current_;
    f["retained_count"] = live_.size();
    f["saved"] = saved;
    f["peak_forward"] = peak_;
    f["peak_forward_count"] = peak_live_.size();
    f["peak_forward_tensors"] = top(peak_live_);
    return f;
  }

  py::dict mark_outputs(const std::vector<int64_t>& keys) {
    drain();
    outputs_.clear();
    for (int64_t k : keys) {
      Key key = reinterpret_cast<Key>(k);
      outputs_.insert(key);
      auto it = live_.find(key);
      if (it != live_.end()) it->second->output = true;
    }
    py::dict f;
    f["retained_tensors"] = top(ordered(retained_));
    return f;
  }

  void backward_start() {
    settle();
    peak_ = current_;
    peak_live_ = values();
  }

  py::dict backward_end() {
    settle();
    left_.clear();
    for (const auto& kv : ordered_pairs(retained_)) {
      auto it = live_.find(kv.first);
      if (it != live_.end() && it->second == kv.second && !outputs_.count(kv.first)) left_.push_back(kv);
    }
    py::dict f;
    f["peak_backward"] = peak_;
    f["peak_backward_count"] = peak_live_.size();
    f["peak_backward_tensors"] = top(peak_live_);
    leftover(f);
    return f;
  }

  py::dict gradients(const std::vector<int64_t>& keys) {
    drain();
    std::unordered_set<Key> grads;
    for (int64_t k : keys) grads.insert(reinterpret_cast<Key>(k));
    left_.erase(std::remove_if(left_.begin(), left_.end(), [&](const auto& kv) { return grads.count(kv.first) > 0; }),
                left_.end());
    py::dict f;
    leftover(f);
    return f;
  }

 private:
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    if (tl_ledger == nullptr || tl_call != nullptr || c10::impl::tls_is_dispatch_key_excluded(c10::DispatchKey::Python)) {
      return nullptr;
    }
    const OpInfo& info = op_info(fn);
    if (!info.op || (!info.seen_by_a_mode && decomposes(fn))) return nullptr;
    auto call = std::make_unique<Call>();
    call->info = &info;
    if (!info.fresh_outputs || info.collective) {  // a c10d op returns its tensors, unannotated
      for (const c10::IValue& v : fn.inputs()) {
        each_tensor(v, [&](const at::Tensor& t) {
          call->args.push_back(key_of(t));
          if (info.collective && tl_ledger->unaliased_.empty() && !tl_ledger->aliased(t)) tl_ledger->unaliased_ = info.name;
        });
      }
    }
    tl_call = call.get();
    return call;
  }

  // A CompositeImplicitAutograd op is decomposed at the autograd key, above the Python key; where
  // autograd does not apply (inference mode, inference tensors) it reaches the Python key whole.
  static bool decomposes(const at::RecordFunction& fn) {
    if (c10::impl::tls_local_dispatch_key_set().excluded_.has_any(c10::autograd_dispatch_keyset)) return false;
    bool tensors = false, autograd = false;
    for (const c10::IValue& v : fn.inputs()) {
      each_tensor(v, [&](const at::Tensor& t) {
        if (!t.defined()) return;
        tensors = true;
        autograd = autograd || t.key_set().has_any(c10::autograd_dispatch_keyset);
      });
    }
    return autograd || !tensors;
  }

  static void on_end(const at::RecordFunction& fn, at::ObserverContext* ctx) {
    if (ctx == nullptr) return;
    tl_call = nullptr;
    if (tl_ledger != nullptr) tl_ledger->after_op(*static_cast<Call*>(ctx), fn.outputs());
  }

  Entries values() const { return ordered(live_); }

  static std::vector<std::pair<Key, EntryPtr>> ordered_pairs(const std::unordered_map<Key, EntryPtr>& m) {
    std::vector<std::pair<Key, EntryPtr>> out(m.begin(), m.end());
    std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.second->seq < b.second->seq; });
    return out;
  }

  static Entries ordered(const std::unordered_map<Key, EntryPtr>& m) {
    Entries out;
    out.reserve(m.size());
    for (const auto& kv : m) out.push_back(kv.second);
    std::sort(out.begin(), out.end(), [](const EntryPtr& a, const EntryPtr& b) { return a->seq < b->seq; });
    return out;
  }

  static py::list top(Entries entries) {
    constexpr size_t TOP = 12;  // memory.TOP
    std::stable_sort(entries.begin(), entries.end(),
                     [](const EntryPtr& a, const EntryPtr& b) { return a->nbytes > b->nbytes; });
    py::list out;
    for (size_t i = 0; i < std::min(TOP, entries.size()); ++i) {
      const Entry& e = *entries[i];
      py::dict d;
      d["shape"] = py::cast(e.shape);
      std::string dtype = py::str(py::handle(reinterpret_cast<PyObject*>(torch::getTHPDtype(e.dtype))));
      d["dtype"] = dtype.substr(dtype.rfind('.') + 1);
      d["bytes"] = e.nbytes;
      d["how"] = e.saved ? "saved" : e.output ? "output" : "alive";
      d["op"] = e.op;
      out.append(d);
    }
    return out;
  }

  void leftover(py::dict& f) {
    int64_t bytes = 0;
    Entries left;
    for (const auto& kv : left_) {
      bytes += kv.second->nbytes;
      left.push_back(kv.second);
    }
    f["leftover"] = bytes;
    f["leftover_tensors"] = top(left);
  }

  std::unordered_set<Key> inputs_;
  std::unordered_map<Key, EntryPtr> live_;
  std::unordered_map<Key, EntryPtr> retained_;
  std::unordered_set<Key> outputs_;
  std::vector<std::pair<Key, EntryPtr>> left_;  // retained, still alive after backward, not an output
  std::unordered_map<Key, std::vector<c10::weak_intrusive_ptr<c10::TensorImpl>>> aliases_;
  int64_t current_ = 0;
  int64_t peak_ = 0;
  Entries peak_live_;
  uint64_t seq_ = 0;
  at::CallbackHandle handle_ = 0;
  std::string unaliased_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Ledger>(m, "Ledger")
      .def(py::init<const std::vector<int64_t>&>())
      .def("attach", &Ledger::attach)
      .def("detach", &Ledger::detach)
      .def("pack", &Ledger::pack)
      .def("alias", &Ledger::alias)
      .def("forward_end", &Ledger::forward_end)
      .def("mark_outputs", &Ledger::mark_outputs)
      .def("backward_start", &Ledger::backward_start)
      .def("backward_end", &Ledger::backward_end)
      .def("gradients", &Ledger::gradients)
      .def("unaliased", &Ledger::unaliased);
}
