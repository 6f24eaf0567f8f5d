use std::ffi::CStr;
use std::path::Path;
use std::ptr::{self, NonNull};

use pipe_sys as sys;

use crate::error::{check, Error, Result, Status};
use crate::plan::{Plan, PlanOptions};

/// A loaded model: a TorchScript archive (torch.jit.trace or torch.jit.script output) or a
/// torch.export program (torch.export.save output, a `.pt2`); [`Model::format`] says which.
pub struct Model {
    ptr: NonNull<sys::pipe_model>,
}

// SAFETY: pipe.h: pipe_model_load is global, every query on a model (format, num_inputs,
// input_name, num_modules, module) and pipe_plan_create are "thread-safe on the same handle", and only
// pipe_model_destroy is exclusive, which runs in Drop with sole ownership. So a Model may move
// between threads (Send) and be used through &Model from many at once (Sync).
unsafe impl Send for Model {}
unsafe impl Sync for Model {}

/// One module of the model's tree (see [`Model::modules`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModuleInfo {
    /// Dotted path, "" for the root ("blocks.0.up").
    pub path: String,
    /// Class name ("Linear").
    pub type_name: String,
    /// 0 for the root.
    pub depth: i32,
    /// Parameters held by the module and its descendants (shared tensors counted once).
    pub num_params: u64,
    pub param_bytes: u64,
}

/// What kind of file a model was loaded from ([`Model::format`]; pipe.h's PIPE_MODEL_*).
/// Displayed as "torchscript" and "exported".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ModelFormat {
    /// A TorchScript archive; its plans' stages save as TorchScript (`.pt`).
    /// `PIPE_MODEL_TORCHSCRIPT`.
    TorchScript,
    /// A torch.export program; its plans' stages save as programs (`.pt2`). `PIPE_MODEL_EXPORTED`.
    Exported,
}

impl ModelFormat {
    /// "torchscript" or "exported".
    pub fn name(self) -> &'static str {
        match self {
            ModelFormat::TorchScript => "torchscript",
            ModelFormat::Exported => "exported",
        }
    }

    fn from_raw(raw: i32) -> Result<ModelFormat> {
        match raw {
            sys::PIPE_MODEL_TORCHSCRIPT => Ok(ModelFormat::TorchScript),
            sys::PIPE_MODEL_EXPORTED => Ok(ModelFormat::Exported),
            other => Err(Error::new(Status::Internal, format!("libpipe reported an unknown model format {other}"))),
        }
    }
}

impl std::fmt::Display for ModelFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Model {
    /// Load a TorchScript archive (torch.jit.trace / torch.jit.script, saved with `.save()`) or a
    /// torch.export program (torch.export.save); the file's content decides which, never its
    /// name. A model file is code: load only models you trust. [`Status::NotFound`] if the file
    /// is missing, [`Status::InvalidFormat`] if it is neither (or a TorchScript archive without a
    /// forward method), [`Status::Unsupported`] for an exported program libpipe cannot run (the
    /// message says what to export instead).
    pub fn load(path: impl AsRef<Path>) -> Result<Model> {
        let c = crate::path_cstring(path.as_ref())?;
        let mut model = ptr::null_mut();
        // SAFETY: global; `c` outlives the call; `model` is written only on success.
        check(unsafe { sys::pipe_model_load(c.as_ptr(), &mut model) })?;
        NonNull::new(model)
            .map(|ptr| Model { ptr })
            .ok_or_else(|| Error::new(Status::Internal, "libpipe returned a NULL model"))
    }

    pub(crate) fn as_ptr(&self) -> *const sys::pipe_model {
        self.ptr.as_ptr()
    }

    /// What the model file was (pipe_model_format, libpipe >= 0.10).
    pub fn format(&self) -> Result<ModelFormat> {
        let mut raw = 0i32;
        // SAFETY: thread-safe; `raw` is written only on success.
        check(unsafe { sys::pipe_model_format(self.as_ptr(), &mut raw) })?;
        ModelFormat::from_raw(raw)
    }

    /// Number of forward arguments (not counting self).
    pub fn num_inputs(&self) -> Result<usize> {
        let mut n = 0usize;
        // SAFETY: thread-safe.
        check(unsafe { sys::pipe_model_num_inputs(self.as_ptr(), &mut n) })?;
        Ok(n)
    }

    /// The forward arguments' names, in order ("x", "input_ids", ...): the order
    /// [`crate::Session::run`] takes its inputs in.
    pub fn input_names(&self) -> Result<Vec<String>> {
        (0..self.num_inputs()?)
            .map(|i| {
                let mut name = ptr::null();
                // SAFETY: thread-safe; the string is copied while the model is alive.
                check(unsafe { sys::pipe_model_input_name(self.as_ptr(), i, &mut name) })?;
                Ok(unsafe { crate::copy_cstr(name) })
            })
            .collect()
    }

    /// The module tree in pre-order, the root first.
    pub fn modules(&self) -> Result<Vec<ModuleInfo>> {
        let mut count = 0usize;
        // SAFETY: thread-safe.
        check(unsafe { sys::pipe_model_num_modules(self.as_ptr(), &mut count) })?;
        (0..count)
            .map(|i| {
                let (mut path, mut type_name) = (ptr::null(), ptr::null());
                let (mut depth, mut num_params, mut param_bytes) = (0i32, 0u64, 0u64);
                // SAFETY: thread-safe; the strings are copied while the model is alive.
                check(unsafe {
                    sys::pipe_model_module(
                        self.as_ptr(),
                        i,
                        &mut path,
                        &mut type_name,
                        &mut depth,
                        &mut num_params,
                        &mut param_bytes,
                    )
                })?;
                Ok(ModuleInfo {
                    path: unsafe { CStr::from_ptr(path) }.to_string_lossy().into_owned(),
                    type_name: unsafe { CStr::from_ptr(type_name) }.to_string_lossy().into_owned(),
                    depth,
                    num_params,
                    param_bytes,
                })
            })
            .collect()
    }

    /// Cut the model into stages; the same as [`Plan::new`].
    pub fn plan(&self, options: &PlanOptions) -> Result<Plan> {
        Plan::new(self, options)
    }
}

impl Drop for Model {
    fn drop(&mut self) {
        // SAFETY: exclusive; we own it. Plans and sessions made from it stay valid.
        unsafe { sys::pipe_model_destroy(self.ptr.as_ptr()) }
    }
}
