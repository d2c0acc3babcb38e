// cuBLAS GEMMs for the prefill / extend matmuls of a dsv2-mlc CUDA build (`compile --gemm cublas`).
//
// Compiled into the model library by `dsv2_mlc.compiler.extern_gemm`; loading the library
// registers these global functions (TVM FFI), which the Relax VM calls through
// `call_dps_packed` (passes/dispatch_cublas_gemm.py):
//
//   dsv2.cublas.gemm_nt(x [n, k] f16, w [o, k] f16, out [n, o] f16|f32)   out = x @ w^T
//       float32 accumulation, one rounding to out's dtype; on the stream TVM runs on
//       (TVMFFIEnvGetStream), so it orders with the generated kernels.
//   dsv2.cublas.init(path: str) -> str   dlopen libcublas (the runtime finds it, see
//       runtime/cublas.py) and return the path opened; idempotent.
//   dsv2.cublas.version(device: int) -> int   cublasGetVersion (scripts/gpu_cublas_check.py).
//   dsv2.cublas.set_workspace(ws: uint8 tensor) -> int   the workspace every GEMM on ws's device
//       runs with from then on (cublasSetWorkspace, again after each cublasSetStream, which
//       resets it); the first one a device gets stays, held for the process, and its size is
//       returned. Without it cuBLAS allocates its workspace itself: inside a CUDA graph capture
//       as memory-allocation nodes (cuMemAllocAsync), one allocation per captured graph, and
//       nodes whose parameters a graph move (runtime/graph_relocation.py) cannot compare. The
//       runtime runs every GEMM of a device on one stream or on graph streams that
//       synchronize with it (runtime/cuda_graph.py), so one workspace a device is never used
//       by two GEMMs at once.
//
// libcublas is opened at run time, not linked: the build box needs no cuBLAS, and a library
// that never runs a prefill GEMM (or one compiled without --gemm cublas) loads without it. The
// few declarations below are cuBLAS' stable v2 C ABI (cublas_api.h, CUDA 12 and 13).
#include <dlfcn.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/error.h>
#include <tvm/ffi/extra/c_env_api.h>
#include <tvm/ffi/function.h>
#include <tvm/ffi/string.h>

#include <cstdint>
#include <limits>
#include <mutex>
#include <string>
#include <utility>

namespace {

using Handle = void*;
using Status = int;
constexpr int kOpN = 0;            // CUBLAS_OP_N
constexpr int kOpT = 1;            // CUBLAS_OP_T
constexpr int kR32F = 0;           // CUDA_R_32F
constexpr int kR16F = 2;           // CUDA_R_16F
constexpr int kR16BF = 14;         // CUDA_R_16BF
constexpr int kCompute32F = 68;    // CUBLAS_COMPUTE_32F
constexpr int kGemmDefault = -1;   // CUBLAS_GEMM_DEFAULT
constexpr int kMaxDevices = 64;

using CreateFn = Status (*)(Handle*);
using SetStreamFn = Status (*)(Handle, void*);
using GetVersionFn = Status (*)(Handle, int*);
using SetWorkspaceFn = Status (*)(Handle, void*, size_t);
using StatusStringFn = const char* (*)(Status);
using GemmExFn = Status (*)(Handle, int, int, int, int, int, const void*, const void*, int, int,
                            const void*, int, int, const void*, void*, int, int, int, int);

struct Cublas {
  std::mutex mutex;
  void* lib = nullptr;
  std::string path;
  CreateFn create = nullptr;
  SetStreamFn set_stream = nullptr;
  GetVersionFn get_version = nullptr;
  StatusStringFn status_string = nullptr;
  GemmExFn gemm_ex = nullptr;
  SetWorkspaceFn set_workspace = nullptr;
  Handle handles[kMaxDevices] = {};
  tvm::ffi::Tensor workspaces[kMaxDevices];
};

// Never destroyed: the workspaces stay valid for every graph captured with them, and no device
// memory is freed while the CUDA runtime shuts down at exit.
Cublas& State() {
  static Cublas* state = new Cublas();
  return *state;
}

void* Symbol(Cublas& c, const char* name) {
  void* sym = dlsym(c.lib, name);
  if (sym == nullptr) {
    TVM_FFI_THROW(RuntimeError) << c.path << " has no " << name
                                << ": not a cuBLAS v2 library (CUDA 12 or 13)";
  }
  return sym;
}

void Check(Cublas& c, Status status, const char* what) {
  if (status != 0) {
    TVM_FFI_THROW(RuntimeError) << what << " failed: " << c.status_string(status) << " ("
                                << status << ")";
  }
}

// Open libcublas at `path` (once per process; later calls must name the same library).
std::string Init(const std::string& path) {
  Cublas& c = State();
  std::lock_guard<std::mutex> lock(c.mutex);
  if (c.lib == nullptr) {
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (lib == nullptr) {
      TVM_FFI_THROW(RuntimeError) << "cannot open cuBLAS " << path << ": " << dlerror();
    }
    c.lib = lib;
    c.path = path;
    c.create = reinterpret_cast<CreateFn>(Symbol(c, "cublasCreate_v2"));
    c.set_stream = reinterpret_cast<SetStreamFn>(Symbol(c, "cublasSetStream_v2"));
    c.get_version = reinterpret_cast<GetVersionFn>(Symbol(c, "cublasGetVersion_v2"));
    c.status_string = reinterpret_cast<StatusStringFn>(Symbol(c, "cublasGetStatusString"));
    c.gemm_ex = reinterpret_cast<GemmExFn>(Symbol(c, "cublasGemmEx"));
    c.set_workspace = reinterpret_cast<SetWorkspaceFn>(Symbol(c, "cublasSetWorkspace_v2"));
  }
  return c.path;
}

// The handle of `device` (created on first use, on the device current at that time: the VM's).
Handle DeviceHandle(Cublas& c, int device) {
  if (device < 0 || device >= kMaxDevices) {
    TVM_FFI_THROW(ValueError) << "CUDA device " << device << " out of range";
  }
  std::lock_guard<std::mutex> lock(c.mutex);
  if (c.lib == nullptr) {
    TVM_FFI_THROW(RuntimeError)
        << "cuBLAS is not loaded: call dsv2.cublas.init first (dsv2_mlc.runtime does when it "
           "loads a build compiled with --gemm cublas)";
  }
  if (c.handles[device] == nullptr) {
    Handle handle = nullptr;
    Check(c, c.create(&handle), "cublasCreate");
    c.handles[device] = handle;
  }
  return c.handles[device];
}

int CudaType(DLDataType t, const char* name) {
  if (t.code == kDLFloat && t.bits == 16 && t.lanes == 1) return kR16F;
  if (t.code == kDLBfloat && t.bits == 16 && t.lanes == 1) return kR16BF;
  if (t.code == kDLFloat && t.bits == 32 && t.lanes == 1) return kR32F;
  TVM_FFI_THROW(TypeError) << name << ": unsupported dtype (float16, bfloat16 or float32)";
}

void* Data(const tvm::ffi::TensorView& t) {
  return static_cast<char*>(t.data_ptr()) + t.byte_offset();
}

int Dim(int64_t value, const char* what) {
  if (value < 0 || value > std::numeric_limits<int>::max()) {
    TVM_FFI_THROW(ValueError) << what << " = " << value << " does not fit cuBLAS' int";
  }
  return static_cast<int>(value);
}

void CheckMatrix(const tvm::ffi::TensorView& t, const char* name, int device) {
  if (t.ndim() != 2 || !t.IsContiguous()) {
    TVM_FFI_THROW(ValueError) << name << ": a contiguous 2-D tensor is required";
  }
  if (t.device().device_type != kDLCUDA || t.device().device_id != device) {
    TVM_FFI_THROW(ValueError) << name << ": not on CUDA device " << device;
  }
}

// out[n, o] = x[n, k] @ w[o, k]^T. Row-major out is column-major out^T = w (op T) x^T (op N).
void GemmNT(tvm::ffi::TensorView x, tvm::ffi::TensorView w, tvm::ffi::TensorView out) {
  const int device = x.device().device_id;
  CheckMatrix(x, "x", device);
  CheckMatrix(w, "w", device);
  CheckMatrix(out, "out", device);
  const int n = Dim(x.size(0), "n"), k = Dim(x.size(1), "k"), o = Dim(w.size(0), "o");
  if (w.size(1) != k || out.size(0) != n || out.size(1) != o) {
    TVM_FFI_THROW(ValueError) << "gemm_nt shapes: x [" << x.size(0) << ", " << x.size(1)
                              << "], w [" << w.size(0) << ", " << w.size(1) << "], out ["
                              << out.size(0) << ", " << out.size(1) << "]";
  }
  const int in_type = CudaType(x.dtype(), "x");
  if (in_type == kR32F || CudaType(w.dtype(), "w") != in_type) {
    TVM_FFI_THROW(TypeError) << "gemm_nt: x and w must both be float16 or both bfloat16";
  }
  const int out_type = CudaType(out.dtype(), "out");
  if (n == 0 || o == 0) return;
  Cublas& c = State();
  Handle handle = DeviceHandle(c, device);
  Check(c, c.set_stream(handle, TVMFFIEnvGetStream(kDLCUDA, device)), "cublasSetStream");
  const tvm::ffi::Tensor& ws = c.workspaces[device];
  if (ws.defined()) {
    void* data = static_cast<char*>(ws.data_ptr()) + ws.byte_offset();
    Check(c, c.set_workspace(handle, data, static_cast<size_t>(ws.size(0))),
          "cublasSetWorkspace");
  }
  const float alpha = 1.0f, beta = 0.0f;
  Check(c,
        c.gemm_ex(handle, kOpT, kOpN, o, n, k, &alpha, Data(w), in_type, k, Data(x), in_type, k,
                  &beta, Data(out), out_type, o, kCompute32F, kGemmDefault),
        "cublasGemmEx");
}

// Give `ws`'s device its workspace (the first one stays); the workspace's size in bytes.
int64_t SetWorkspace(tvm::ffi::Tensor ws) {
  const int device = ws.device().device_id;
  if (ws.ndim() != 1 || ws.dtype().code != kDLUInt || ws.dtype().bits != 8 ||
      !ws.IsContiguous() || ws.device().device_type != kDLCUDA) {
    TVM_FFI_THROW(ValueError) << "set_workspace: a contiguous 1-D uint8 CUDA tensor is required";
  }
  Cublas& c = State();
  DeviceHandle(c, device);  // cuBLAS loaded, the device in range
  std::lock_guard<std::mutex> lock(c.mutex);
  if (!c.workspaces[device].defined()) c.workspaces[device] = ws;
  return c.workspaces[device].size(0);
}

int Version(int device) {
  Cublas& c = State();
  int version = 0;
  Check(c, c.get_version(DeviceHandle(c, device), &version), "cublasGetVersion");
  return version;
}

// Register once per process: the first library that loads wins and is pinned in memory
// (RTLD_NODELETE), so the functions stay valid when that module is released and other builds
// loaded later (each carries this file) find them registered.
void Register(const char* name, tvm::ffi::Function func) {
  if (!tvm::ffi::Function::GetGlobal(name).has_value()) {
    tvm::ffi::Function::SetGlobal(name, std::move(func));
  }
}

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  Dl_info self;
  if (dladdr(reinterpret_cast<void*>(&GemmNT), &self) != 0 && self.dli_fname != nullptr) {
    dlopen(self.dli_fname, RTLD_NOW | RTLD_NODELETE);
  }
  Register("dsv2.cublas.init", tvm::ffi::Function::FromTyped([](tvm::ffi::String path) {
             return tvm::ffi::String(Init(std::string(path)));
           }));
  Register("dsv2.cublas.version",
           tvm::ffi::Function::FromTyped([](int device) { return Version(device); }));
  Register("dsv2.cublas.gemm_nt", tvm::ffi::Function::FromTyped(GemmNT));
  Register("dsv2.cublas.set_workspace", tvm::ffi::Function::FromTyped(SetWorkspace));
}
