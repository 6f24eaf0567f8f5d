use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::ptr::{self, NonNull};

use pipe_sys as sys;

use crate::error::{check, Error, Result, Status};
use crate::model::Model;
use crate::session::borrow_inputs;
use crate::tensor::Tensor;

/// How [`PlanOptions::stages`] chooses the cuts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Equal numbers of layers per stage.
    Uniform,
    /// The cut minimising the largest stage's parameter bytes.
    Params,
    /// The cut minimising the slowest stage, measured on the example inputs.
    Time,
}

impl Policy {
    /// The name pipe.h uses ("uniform", "params", "time").
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Uniform => "uniform",
            Policy::Params => "params",
            Policy::Time => "time",
        }
    }
}

/// How to cut a model. Empty (the default): at the `pipe::split()` markers in the model code.
///
/// A plain Rust value (cloneable, shareable); it becomes libpipe's option builder only inside
/// [`Plan::new`], so mistakes are reported there, by libpipe.
#[derive(Clone, Debug, Default)]
pub struct PlanOptions {
    split_points: Vec<String>,
    stages: Option<(usize, Policy)>,
    example_inputs: Vec<Tensor>,
}

impl PlanOptions {
    pub fn new() -> PlanOptions {
        PlanOptions::default()
    }

    /// Cut at a module boundary: "FQN:begin" just before module FQN runs, "FQN:end" just after
    /// ("blocks.2:begin"); "FQN@K:end" picks the module's K-th call. Repeatable.
    pub fn split_point(mut self, split_point: impl Into<String>) -> PlanOptions {
        self.split_points.push(split_point.into());
        self
    }

    /// Ask for `num_stages` stages chosen by `policy` instead of split points.
    pub fn stages(mut self, num_stages: usize, policy: Policy) -> PlanOptions {
        self.stages = Some((num_stages, policy));
        self
    }

    /// Example inputs (forward's arguments in order): required by [`Policy::Time`]; with any
    /// split they make the plan report each stage's measured time.
    pub fn example_inputs(mut self, inputs: Vec<Tensor>) -> PlanOptions {
        self.example_inputs = inputs;
        self
    }
}

/// libpipe's pipe_plan_options builder, alive only inside Plan::new.
struct RawPlanOptions(NonNull<sys::pipe_plan_options>);

impl RawPlanOptions {
    fn new(options: &PlanOptions) -> Result<RawPlanOptions> {
        let mut p = ptr::null_mut();
        // SAFETY: creates a new handle that we own.
        check(unsafe { sys::pipe_plan_options_create(&mut p) })?;
        let raw = RawPlanOptions(
            NonNull::new(p).ok_or_else(|| Error::new(Status::Internal, "libpipe returned NULL plan options"))?,
        );
        // SAFETY (all calls below): the handle is exclusive per handle and used only by this
        // thread; string and tensor arguments outlive each call (example inputs are copied).
        for sp in &options.split_points {
            let c = crate::cstring("split point", sp)?;
            check(unsafe { sys::pipe_plan_options_add_split_point(raw.0.as_ptr(), c.as_ptr()) })?;
        }
        if let Some((n, policy)) = options.stages {
            let n =
                i32::try_from(n).map_err(|_| Error::new(Status::InvalidArgument, format!("{n} stages is too many")))?;
            let c = crate::cstring("policy", policy.as_str())?;
            check(unsafe { sys::pipe_plan_options_set_stages(raw.0.as_ptr(), n, c.as_ptr()) })?;
        }
        if !options.example_inputs.is_empty() {
            let inputs = borrow_inputs(&options.example_inputs);
            check(unsafe { sys::pipe_plan_options_set_example_inputs(raw.0.as_ptr(), inputs.as_ptr(), inputs.len()) })?;
        }
        Ok(raw)
    }
}

impl Drop for RawPlanOptions {
    fn drop(&mut self) {
        // SAFETY: exclusive; we own it.
        unsafe { sys::pipe_plan_options_destroy(self.0.as_ptr()) }
    }
}

/// Which names [`Plan::names`] lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Names {
    Parameters,
    Buffers,
}

/// Float dtype for a stage's weights (and inputs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WeightDType {
    #[default]
    Keep,
    F32,
    F16,
    BF16,
}

/// How CPU stages store their linear layers' weights (pipe.h's `PIPE_QUANTIZE_*`; libpipe >= 0.13).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Quantization {
    /// The weights stay in the stage's dtype.
    #[default]
    None,
    /// 8-bit codes with a float32 scale per output feature; activations stay in the stage's dtype.
    Int8,
    /// 4-bit codes with a float16 scale per `group` inputs (32, 64 or 128; 0: 32) and output feature, as
    /// llama.cpp's Q4_0; the activations are rounded to int8 per block of 32 inside the product (libpipe >= 0.14).
    Int4 { group: i64 },
}

/// How CPU stages store the output head, the linear layer whose result the model returns (a decoder's
/// `lm_head`), when the weights are quantized (pipe.h's `PIPE_QUANTIZE_HEAD_*`; libpipe >= 0.16).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HeadQuantization {
    /// As the other weights under [`Quantization::Int8`], 8-bit under [`Quantization::Int4`]: every token's
    /// logits go through the head, and 4-bit codes there cost far more quality than anywhere else.
    #[default]
    Default,
    /// 8-bit codes with a float32 scale per output feature.
    Int8,
    /// 4-bit codes in the groups of [`Quantization::Int4`] (32 under [`Quantization::Int8`]).
    Int4,
    /// The stage's dtype, unquantized.
    None,
}

/// How CPU stages store embedding tables (pipe.h's `PIPE_QUANTIZE_EMBEDDING_*`; libpipe >= 0.17), with or
/// without [`StageOptions::quantize`]: it saves memory, not time. A table tied to a linear layer of its stage
/// keeps its dtype; exported (.pt2) models refuse it ([`Status::Unsupported`](crate::Status::Unsupported)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum EmbeddingQuantization {
    /// The table's dtype.
    #[default]
    None,
    /// 8-bit codes with a float32 scale per row (token).
    Int8,
}

/// How each stage gets its weights.
#[derive(Clone, Debug, Default)]
pub struct StageOptions {
    pub dtype: WeightDType,
    /// A .safetensors file or a *.safetensors.index.json; None keeps the model's own weights.
    pub weights: Option<PathBuf>,
    pub quantize: Quantization,
    /// The output head's storage; anything but [`HeadQuantization::Default`] without `quantize` is
    /// [`Status::InvalidArgument`](crate::Status::InvalidArgument) (libpipe >= 0.16).
    pub quantize_head: HeadQuantization,
    /// The embedding tables' storage (libpipe >= 0.17).
    pub quantize_embedding: EmbeddingQuantization,
}

/// A pipe_stage_options and the C string it points into.
pub(crate) struct RawStageOptions {
    pub(crate) raw: sys::pipe_stage_options,
    _weights: Option<CString>,
}

impl StageOptions {
    pub(crate) fn to_raw(&self) -> Result<RawStageOptions> {
        let mut raw = crate::defaults::stage_options()?;
        raw.dtype = match self.dtype {
            WeightDType::Keep => sys::PIPE_DTYPE_KEEP,
            WeightDType::F32 => sys::PIPE_DTYPE_FLOAT32,
            WeightDType::F16 => sys::PIPE_DTYPE_FLOAT16,
            WeightDType::BF16 => sys::PIPE_DTYPE_BFLOAT16,
        };
        raw.quantize = match self.quantize {
            Quantization::None => sys::PIPE_QUANTIZE_NONE,
            Quantization::Int8 => sys::PIPE_QUANTIZE_INT8,
            Quantization::Int4 { .. } => sys::PIPE_QUANTIZE_INT4,
        };
        if let Quantization::Int4 { group } = self.quantize {
            raw.quantize_group = group;
        }
        raw.quantize_head = match self.quantize_head {
            HeadQuantization::Default => sys::PIPE_QUANTIZE_HEAD_DEFAULT,
            HeadQuantization::Int8 => sys::PIPE_QUANTIZE_HEAD_INT8,
            HeadQuantization::Int4 => sys::PIPE_QUANTIZE_HEAD_INT4,
            HeadQuantization::None => sys::PIPE_QUANTIZE_HEAD_NONE,
        };
        raw.quantize_embedding = i64::from(match self.quantize_embedding {
            EmbeddingQuantization::None => sys::PIPE_QUANTIZE_EMBEDDING_NONE,
            EmbeddingQuantization::Int8 => sys::PIPE_QUANTIZE_EMBEDDING_INT8,
        });
        let weights = self.weights.as_deref().map(crate::path_cstring).transpose()?;
        // The CString's heap buffer does not move when the CString does.
        raw.weights = weights.as_ref().map_or(ptr::null(), |c| c.as_ptr());
        Ok(RawStageOptions { raw, _weights: weights })
    }
}

/// The model cut into stages.
pub struct Plan {
    ptr: NonNull<sys::pipe_plan>,
}

// SAFETY: pipe.h marks every query on a plan (num_stages, stage_count_names, stage_name,
// stage_param_bytes, stage_estimated_ms, save_stage, describe) and pipe_session_create
// "thread-safe"; only pipe_plan_destroy is exclusive and runs in Drop with sole ownership.
unsafe impl Send for Plan {}
unsafe impl Sync for Plan {}

impl Plan {
    /// Cut `model` as `options` say. [`Status::Split`] when it cannot be cut so (the message
    /// names the offending module, and the nearest existing ones for an unknown name);
    /// [`Status::InvalidArgument`] for split points together with a stage count, or N < 1.
    pub fn new(model: &Model, options: &PlanOptions) -> Result<Plan> {
        let raw = RawPlanOptions::new(options)?;
        let mut plan = ptr::null_mut();
        // SAFETY: thread-safe on the model; the options are only read and outlive the call.
        check(unsafe { sys::pipe_plan_create(model.as_ptr(), raw.0.as_ptr(), &mut plan) })?;
        NonNull::new(plan)
            .map(|ptr| Plan { ptr })
            .ok_or_else(|| Error::new(Status::Internal, "libpipe returned a NULL plan"))
    }

    pub(crate) fn as_ptr(&self) -> *const sys::pipe_plan {
        self.ptr.as_ptr()
    }

    pub fn num_stages(&self) -> Result<usize> {
        let mut n = 0usize;
        // SAFETY: thread-safe.
        check(unsafe { sys::pipe_plan_num_stages(self.as_ptr(), &mut n) })?;
        Ok(n)
    }

    /// Names of the parameters or buffers stage `stage` reads (original dotted names).
    pub fn names(&self, stage: usize, kind: Names) -> Result<Vec<String>> {
        let kind = match kind {
            Names::Parameters => sys::PIPE_NAMES_PARAMETERS,
            Names::Buffers => sys::PIPE_NAMES_BUFFERS,
        };
        let mut n = 0usize;
        // SAFETY: thread-safe; names are copied while the plan is alive.
        check(unsafe { sys::pipe_plan_stage_count_names(self.as_ptr(), stage, kind, &mut n) })?;
        (0..n)
            .map(|i| {
                let mut name = ptr::null();
                check(unsafe { sys::pipe_plan_stage_name(self.as_ptr(), stage, kind, i, &mut name) })?;
                Ok(unsafe { crate::copy_cstr(name) })
            })
            .collect()
    }

    pub fn parameters(&self, stage: usize) -> Result<Vec<String>> {
        self.names(stage, Names::Parameters)
    }

    pub fn buffers(&self, stage: usize) -> Result<Vec<String>> {
        self.names(stage, Names::Buffers)
    }

    /// Bytes of parameters and buffers stage `stage` holds.
    pub fn param_bytes(&self, stage: usize) -> Result<u64> {
        let mut b = 0u64;
        // SAFETY: thread-safe.
        check(unsafe { sys::pipe_plan_stage_param_bytes(self.as_ptr(), stage, &mut b) })?;
        Ok(b)
    }

    /// Bytes stage `stage`'s parameters and buffers would take as a CPU stage built with `options` (None: the
    /// model's own weights), linear layers' weights as panels or codes as `quantize` and `quantize_head` say,
    /// worked out from the shapes with nothing loaded (libpipe >= 0.16). [`Status::Unsupported`] for quantized
    /// weights where the CPU has no kernels for them; [`Status::InvalidArgument`] for options a session refuses.
    pub fn weight_bytes(&self, stage: usize, options: Option<&StageOptions>) -> Result<u64> {
        let raw = options.map(StageOptions::to_raw).transpose()?;
        let opts = raw.as_ref().map_or(ptr::null(), |r| &r.raw as *const _);
        let mut b = 0u64;
        // SAFETY: thread-safe; the options outlive the call.
        check(unsafe { sys::pipe_plan_stage_weight_bytes(self.as_ptr(), stage, opts, &mut b) })?;
        Ok(b)
    }

    /// Measured time of stage `stage` on the example inputs in milliseconds; None when the plan
    /// was made without example inputs.
    pub fn estimated_ms(&self, stage: usize) -> Result<Option<f64>> {
        let mut ms = 0f64;
        // SAFETY: thread-safe.
        check(unsafe { sys::pipe_plan_stage_estimated_ms(self.as_ptr(), stage, &mut ms) })?;
        Ok(if ms < 0.0 { None } else { Some(ms) })
    }

    /// The whole plan as JSON (see pipe_plan_describe in pipe.h for the fields).
    pub fn describe(&self) -> Result<String> {
        let mut json = ptr::null();
        // SAFETY: thread-safe; the string lives until the plan is destroyed and is copied now.
        check(unsafe { sys::pipe_plan_describe(self.as_ptr(), &mut json) })?;
        Ok(unsafe { CStr::from_ptr(json) }.to_string_lossy().into_owned())
    }

    /// Save stage `stage` as a standalone model of the plan's format ([`Model::format`]): a TorchScript
    /// file, or for an exported program a `.pt2` holding one program named "model", with only its
    /// own weights.
    pub fn save_stage(&self, stage: usize, path: impl AsRef<Path>, options: Option<&StageOptions>) -> Result<()> {
        let c = crate::path_cstring(path.as_ref())?;
        let raw = options.map(StageOptions::to_raw).transpose()?;
        let opts = raw.as_ref().map_or(ptr::null(), |r| &r.raw as *const _);
        // SAFETY: thread-safe; every pointer outlives the call.
        check(unsafe { sys::pipe_plan_save_stage(self.as_ptr(), stage, opts, c.as_ptr()) })
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: exclusive; we own it. Sessions made from it stay valid.
        unsafe { sys::pipe_plan_destroy(self.ptr.as_ptr()) }
    }
}
