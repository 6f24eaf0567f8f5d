//! Versioned structs started from libpipe's own defaults at run time (pipe_*_init, the *_INIT
//! macros as functions), so that this crate never re-implements a macro.

use std::mem::size_of;

use pipe_sys as sys;

use crate::error::{check, Result};

macro_rules! started_from_init {
    ($(#[$doc:meta])* $name:ident: $ty:ident by $init:ident) => {
        $(#[$doc])*
        pub(crate) fn $name() -> Result<sys::$ty> {
            let mut raw = sys::$ty::default();
            // SAFETY: global; it writes the fields that the given struct_size covers, and `raw`
            // is that large.
            check(unsafe { sys::$init(&mut raw, size_of::<sys::$ty>()) })?;
            Ok(raw)
        }
    };
}

started_from_init!(
    /// PIPE_STAGE_OPTIONS_INIT.
    stage_options: pipe_stage_options by pipe_stage_options_init
);
started_from_init!(
    /// PIPE_SESSION_OPTIONS_INIT.
    session_options: pipe_session_options by pipe_session_options_init
);
started_from_init!(
    /// PIPE_RUN_OPTIONS_INIT.
    run_options: pipe_run_options by pipe_run_options_init
);
started_from_init!(
    /// PIPE_STAGE_STATS_INIT.
    stage_stats: pipe_stage_stats by pipe_stage_stats_init
);
started_from_init!(
    /// PIPE_WORKER_OPTIONS_INIT.
    worker_options: pipe_worker_options by pipe_worker_options_init
);
started_from_init!(
    /// PIPE_GENERATOR_OPTIONS_INIT.
    generator_options: pipe_generator_options by pipe_generator_options_init
);
started_from_init!(
    /// PIPE_GENERATOR_INFO_INIT.
    generator_info: pipe_generator_info by pipe_generator_info_init
);
started_from_init!(
    /// PIPE_GENERATOR_STATS_INIT.
    generator_stats: pipe_generator_stats by pipe_generator_stats_init
);
started_from_init!(
    /// PIPE_GENERATION_OPTIONS_INIT.
    generation_options: pipe_generation_options by pipe_generation_options_init
);
started_from_init!(
    /// PIPE_GENERATION_INFO_INIT.
    generation_info: pipe_generation_info by pipe_generation_info_init
);
